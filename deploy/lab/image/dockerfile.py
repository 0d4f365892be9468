"""A Dockerfile parser: what the image builder reads from the repository's Dockerfile, so the
Dockerfile stays the one place that names knit's packages, environment, entrypoint and build
context.

It covers what this project's Dockerfile uses: stages, line continuations, comment lines (also
inside a continuation), --flags, ARG before FROM, and Docker's word processing with variable
substitution. Heredocs and the `# escape=` directive are refused, not misread.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from deploy.lab.image.errors import ImageError
from deploy.lab.paths import ROOT

DOCKERFILE = ROOT / "Dockerfile"
FLAG = re.compile(r"--([a-z-]+)(?:=(\S*))?$")
APT_OPTIONS_WITH_VALUE = {"-o", "-t", "-c", "--option", "--target-release", "--config-file"}


class DockerfileError(ImageError):
    pass


@dataclass
class Instruction:
    keyword: str  # upper case
    args: str  # after the keyword and its --flags
    flags: dict[str, str]


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def _last(self, keyword: str) -> str | None:
        """The arguments of the stage's last `keyword` instruction."""
        found = [i.args for i in self.instructions if i.keyword == keyword]
        return found[-1] if found else None

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment after the stage's ENV instructions, starting from `base`: values
        substituted as Docker does (${VAR} from the environment and the stage's ARGs; within
        one instruction, from before it), a key keeping its place when set again."""
        env = dict(base or {})
        args: dict[str, str] = {}
        for instruction in self.instructions:
            if instruction.keyword == "ARG" and "=" in instruction.args:
                name, value = _arg(instruction.args, {**args, **env})
                args[name] = value
            elif instruction.keyword == "ENV":
                env.update(_env_pairs(instruction.args, {**args, **env}))
        return env

    def apt_packages(self) -> list[str]:
        """The packages `apt-get install` / `apt install` names in the stage's RUNs, in order."""
        packages: list[str] = []
        for run in (i.args for i in self.instructions if i.keyword == "RUN"):
            for argv in _shell_commands(run):
                packages.extend(p for p in _apt_install(argv) if p not in packages)
        return packages

    def entrypoint(self) -> list[str] | None:
        found = self._last("ENTRYPOINT")
        return _command_form(found) if found is not None else None

    def cmd(self) -> list[str] | None:
        """CMD; an ENTRYPOINT after the last CMD resets it, as in Docker."""
        cmd = None
        for instruction in self.instructions:
            if instruction.keyword == "CMD":
                cmd = _command_form(instruction.args)
            elif instruction.keyword == "ENTRYPOINT":
                cmd = None
        return cmd

    def user(self) -> str | None:
        found = self._last("USER")
        return found.strip() if found is not None else None

    def workdir(self) -> str | None:
        found = self._last("WORKDIR")
        return found.strip() if found is not None else None

    def copies(self) -> list[tuple[str | None, list[str], str]]:
        """(--from or None, sources, destination) of every COPY and ADD."""
        result: list[tuple[str | None, list[str], str]] = []
        for instruction in self.instructions:
            if instruction.keyword in ("COPY", "ADD"):
                parts = (
                    _json_list(instruction.args)
                    if instruction.args.lstrip().startswith("[")
                    else shlex.split(instruction.args)
                )
                if len(parts) < 2:
                    raise DockerfileError(f"{instruction.keyword} {instruction.args}: no target")
                result.append((instruction.flags.get("from"), parts[:-1], parts[-1]))
        return result


@dataclass
class Dockerfile:
    args: dict[str, str]  # the ARGs before the first FROM, with their defaults
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise DockerfileError(f"no stage named {name!r}")


def parse_dockerfile(text: str) -> Dockerfile:
    """The instructions of a Dockerfile, by stage, and its ARGs before the first FROM."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(text):
        keyword, _, rest = line.strip().partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        flags: dict[str, str] = {}
        while rest.startswith("--"):
            flag, _, remainder = rest.partition(" ")
            match = FLAG.match(flag)
            if match is None:
                raise DockerfileError(f"cannot read the flag {flag!r} of {keyword}")
            flags[match[1]] = match[2] or ""
            rest = remainder.strip()
        if keyword in ("RUN", "COPY", "ADD") and re.search(r"<<-?['\"]?[A-Za-z_]", rest):
            raise DockerfileError(f"heredocs are not supported: {keyword} {rest}")
        if keyword == "FROM":
            image, *alias = rest.split()
            if alias and (len(alias) != 2 or alias[0].upper() != "AS"):
                raise DockerfileError(f"cannot read FROM {rest}")
            base = _substitute(image, args)
            stages.append(Stage(base=base, name=alias[1] if alias else ""))
        elif not stages:
            if keyword != "ARG":
                raise DockerfileError(f"{keyword} before the first FROM")
            name, value = _arg(rest, args)
            args[name] = value
        else:
            stages[-1].instructions.append(Instruction(keyword, rest, flags))
    if not stages:
        raise DockerfileError("no FROM")
    return Dockerfile(args, stages)


def read_dockerfile(path: Path = DOCKERFILE) -> Dockerfile:
    return parse_dockerfile(path.read_text())


def _logical_lines(text: str) -> Iterator[str]:
    pending: list[str] = []
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#"):
            if not pending and re.match(r"#\s*escape\s*=", stripped):
                raise DockerfileError("the escape directive is not supported")
            continue
        if not stripped:
            continue  # also inside a continuation, as Docker allows
        if stripped.endswith("\\"):
            pending.append(raw.rstrip()[:-1])
            continue
        yield " ".join(part.strip() for part in [*pending, raw])
        pending = []
    if pending:
        raise DockerfileError("the last instruction ends in a line continuation")


def _arg(text: str, env: dict[str, str]) -> tuple[str, str]:
    """An ARG's name and default ("" when it has none), substituted from `env`."""
    name, _, default = text.partition("=")
    return name.strip(), words(default, env)[0] if default else ""


def _expand(text: str, i: int, env: dict[str, str]) -> tuple[str, int]:
    """The value of the variable reference at text[i] == '$', and the index after it."""
    if text.startswith("${", i):
        end = text.find("}", i)
        if end < 0:
            raise DockerfileError(f"unterminated ${{ in {text!r}")
        inner = text[i + 2 : end]
        match = re.fullmatch(r"(\w+)(?::([-+])(.*))?", inner)
        if match is None:
            raise DockerfileError(f"unsupported substitution ${{{inner}}}")
        name, op, word = match.groups()
        value = env.get(name, "")
        if op == "-":
            value = value or "".join(words(word, env))
        elif op == "+":
            value = "".join(words(word, env)) if value else ""
        return value, end + 1
    match = re.compile(r"\w+").match(text, i + 1)
    if match is None:
        return "$", i + 1
    return env.get(match[0], ""), match.end()


def words(text: str, env: dict[str, str]) -> list[str]:
    """Docker's word processing: split at unquoted blanks, quotes removed, backslash escapes,
    $VAR/${VAR}/${VAR:-word}/${VAR:+word} substituted except inside single quotes; an unset
    variable is empty."""
    result: list[str] = []
    current: list[str] = []
    started = False
    quote = ""
    i = 0
    while i < len(text):
        char = text[i]
        if quote == "'":
            if char == "'":
                quote = ""
            else:
                current.append(char)
            i += 1
        elif char == "\\" and i + 1 < len(text) and (not quote or text[i + 1] in '"$\\'):
            current.append(text[i + 1])
            i += 2
        elif char == "$":
            value, i = _expand(text, i, env)
            current.append(value)
            started = True
        elif quote == '"':
            if char == '"':
                quote = ""
            else:
                current.append(char)
            i += 1
        elif char in "'\"":
            quote = char
            started = True
            i += 1
        elif char.isspace():
            if current or started:
                result.append("".join(current))
            current, started = [], False
            i += 1
        else:
            current.append(char)
            i += 1
    if quote:
        raise DockerfileError(f"unterminated quote in {text!r}")
    if current or started:
        result.append("".join(current))
    return result


def _substitute(text: str, env: dict[str, str]) -> str:
    """`text` with its variables substituted and its quotes removed, blanks kept."""
    return " ".join(words(text, env))


def _env_pairs(text: str, env: dict[str, str]) -> dict[str, str]:
    parts = words(text, env)
    if parts and "=" not in parts[0]:
        # the legacy `ENV KEY value with blanks` form
        key, _, value = text.strip().partition(" ")
        return {key: _substitute(value.strip(), env)}
    pairs = {}
    for part in parts:
        key, has_value, value = part.partition("=")
        if not has_value or not key:
            raise DockerfileError(f"ENV {text}: {part!r} is not KEY=VALUE")
        pairs[key] = value
    return pairs


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise DockerfileError(f"not a JSON list: {text}") from err
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DockerfileError(f"not a JSON list of strings: {text}")
    return value


def _command_form(text: str) -> list[str]:
    """An ENTRYPOINT's or CMD's argv: the exec (JSON) form, or the shell form under sh -c."""
    text = text.strip()
    if text.startswith("["):
        with contextlib.suppress(DockerfileError):
            return _json_list(text)
    return ["/bin/sh", "-c", text]


def _shell_commands(text: str) -> list[list[str]]:
    """A RUN's simple commands: the exec form, or the shell form split at && || ; | and &."""
    if text.lstrip().startswith("["):
        with contextlib.suppress(DockerfileError):
            return [_json_list(text)]
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    try:
        for token in lexer:
            if token and set(token) <= set("&|;()"):
                commands.append([])
            else:
                commands[-1].append(token)
    except ValueError as err:
        raise DockerfileError(f"cannot split RUN {text}: {err}") from err
    return [command for command in commands if command]


def _apt_install(argv: list[str]) -> list[str]:
    """The packages of an `apt-get install`/`apt install` command, else nothing."""
    argv = list(argv)
    if argv and argv[0] == "env":
        argv.pop(0)
    while argv and re.match(r"\w+=", argv[0]):
        argv.pop(0)
    if not argv or Path(argv[0]).name not in ("apt-get", "apt"):
        return []
    operands: list[str] = []
    args = iter(argv[1:])
    for arg in args:
        if arg in APT_OPTIONS_WITH_VALUE:
            next(args, None)
        elif not arg.startswith("-"):
            operands.append(arg)
    if not operands or operands[0] != "install":
        return []
    return operands[1:]
