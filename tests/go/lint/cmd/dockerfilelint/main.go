// dockerfilelint runs BuildKit's Dockerfile checks (what `docker build --check` reports) on a
// Dockerfile without a daemon or network, and prints the warnings, the parsed stages and the
// build context (the files of the Dockerfile's directory that its .dockerignore lets through,
// matched as BuildKit matches them) as JSON:
//
//	{"warnings": [{"rule", "description", "detail", "line"}],
//	 "metaArgs": {"NAME": "default"},
//	 "stages": [{"name", "base", "commands": [{"name", "code"}]}],
//	 "context": ["relative/path", ...]}
//
// Base images are not fetched: every FROM resolves to an empty linux/amd64 image config, which
// is all the checks need (they look at the Dockerfile, not at the base image's contents).
// Exit status 1 when the Dockerfile does not parse or convert.
//
// usage: dockerfilelint DOCKERFILE
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/moby/buildkit/client/llb"
	"github.com/moby/buildkit/client/llb/sourceresolver"
	"github.com/moby/buildkit/frontend/dockerfile/dockerfile2llb"
	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/linter"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"github.com/moby/patternmatcher"
	"github.com/moby/patternmatcher/ignorefile"
	digest "github.com/opencontainers/go-digest"
)

// emptyImage stands in for every base image: no registry is contacted.
type emptyImage struct{}

var emptyConfig = []byte(`{"architecture":"amd64","os":"linux","config":{}}`)

func (emptyImage) ResolveImageConfig(
	_ context.Context, ref string, _ sourceresolver.Opt,
) (string, digest.Digest, []byte, error) {
	return ref, digest.FromBytes(emptyConfig), emptyConfig, nil
}

type warning struct {
	Rule        string `json:"rule"`
	Description string `json:"description"`
	Detail      string `json:"detail"`
	Line        int    `json:"line"`
}

type command struct {
	Name string `json:"name"`
	Code string `json:"code"`
}

type stage struct {
	Name     string    `json:"name"`
	Base     string    `json:"base"`
	Commands []command `json:"commands"`
}

type report struct {
	Warnings []warning         `json:"warnings"`
	MetaArgs map[string]string `json:"metaArgs"`
	Stages   []stage           `json:"stages"`
	Context  []string          `json:"context"`
}

func lint(ctx context.Context, path string, dt []byte) ([]warning, error) {
	src := llb.Local("context")
	def, err := src.Marshal(ctx)
	if err != nil {
		return nil, err
	}
	sourceMap := llb.NewSourceMap(&src, path, "Dockerfile", dt)
	sourceMap.Definition = def
	results, err := dockerfile2llb.DockerfileLint(ctx, dt, dockerfile2llb.ConvertOpt{
		SourceMap:    sourceMap,
		MetaResolver: emptyImage{},
	})
	if err != nil {
		return nil, err
	}
	if results.Error != nil {
		return nil, fmt.Errorf("%s", results.Error.Message)
	}
	warnings := []warning{}
	for _, w := range results.Warnings {
		line := 0
		if w.Location != nil && len(w.Location.Ranges) > 0 {
			line = int(w.Location.Ranges[0].Start.Line)
		}
		warnings = append(warnings, warning{w.RuleName, w.Description, w.Detail, line})
	}
	return warnings, nil
}

func parse(dt []byte) (map[string]string, []stage, error) {
	ast, err := parser.Parse(bytes.NewReader(dt))
	if err != nil {
		return nil, nil, err
	}
	parsed, metaArgs, err := instructions.Parse(ast.AST, linter.New(&linter.Config{SkipAll: true}))
	if err != nil {
		return nil, nil, err
	}
	args := map[string]string{}
	for _, arg := range metaArgs {
		for _, kv := range arg.Args {
			args[kv.Key] = ""
			if kv.Value != nil {
				args[kv.Key] = *kv.Value
			}
		}
	}
	stages := []stage{}
	for _, s := range parsed {
		commands := []command{}
		for _, c := range s.Commands {
			commands = append(commands, command{c.Name(), fmt.Sprint(c)})
		}
		stages = append(stages, stage{s.Name, s.BaseName, commands})
	}
	return args, stages, nil
}

// buildContext lists the files under dir that dir/.dockerignore does not exclude.
func buildContext(dir string) ([]string, error) {
	var patterns []string
	ignore, err := os.Open(filepath.Join(dir, ".dockerignore"))
	switch {
	case err == nil:
		patterns, err = ignorefile.ReadAll(ignore)
		ignore.Close()
		if err != nil {
			return nil, err
		}
	case !errors.Is(err, fs.ErrNotExist):
		return nil, err
	}
	matcher, err := patternmatcher.New(patterns)
	if err != nil {
		return nil, err
	}
	files := []string{}
	err = filepath.WalkDir(dir, func(path string, entry fs.DirEntry, err error) error {
		if err != nil || entry.IsDir() {
			return err
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil {
			return err
		}
		excluded, err := matcher.MatchesOrParentMatches(rel)
		if err == nil && !excluded {
			files = append(files, rel)
		}
		return err
	})
	return files, err
}

func run(path string) error {
	dt, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	warnings, err := lint(context.Background(), path, dt)
	if err != nil {
		return err
	}
	args, stages, err := parse(dt)
	if err != nil {
		return err
	}
	files, err := buildContext(filepath.Dir(path))
	if err != nil {
		return err
	}
	out := json.NewEncoder(os.Stdout)
	out.SetIndent("", "  ")
	return out.Encode(report{warnings, args, stages, files})
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: dockerfilelint DOCKERFILE")
		os.Exit(2)
	}
	if err := run(os.Args[1]); err != nil {
		fmt.Fprintf(os.Stderr, "dockerfilelint: %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}
