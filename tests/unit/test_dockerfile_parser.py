"""deploy.lab.image's Dockerfile parser: what the image builder reads from the Dockerfile."""

from __future__ import annotations

import pytest

from deploy.lab.image.dockerfile import (
    DOCKERFILE,
    DockerfileError,
    parse_dockerfile,
    read_dockerfile,
    words,
)
from deploy.lab.image.steps import BASE_ENV


def test_the_repository_dockerfile_final_stage():
    dockerfile = read_dockerfile(DOCKERFILE)
    assert [stage.name for stage in dockerfile.stages] == ["portmap", "client", "builder", ""]
    final = dockerfile.final
    assert final.base == dockerfile.args["PYTHON_IMAGE"]
    assert final.apt_packages() == ["iptables", "nftables", "kmod"]
    assert final.entrypoint() == ["knit-proxyd"]
    assert final.cmd() is None
    assert final.user() == "root"
    env = final.env({"PATH": "/usr/bin:/bin"})
    assert env == {"PATH": "/opt/knit/venv/bin:/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}
    assert final.copies() == [
        ("builder", ["/opt/knit/venv"], "/opt/knit/venv"),
        ("builder", ["/opt/knit/cni-bundle"], "/opt/knit/cni-bundle"),
    ]


def test_the_repository_dockerfile_builder_stage():
    builder = read_dockerfile(DOCKERFILE).stage("builder")
    env = builder.env(BASE_ENV)
    assert env["PIP_NO_CACHE_DIR"] == "1"
    assert env["PATH"] == "/opt/knit/venv/bin:" + BASE_ENV["PATH"]
    sources = [sources for origin, sources, _ in builder.copies() if origin is None]
    assert sources == [["pyproject.toml", "README.md"], ["cni"], ["proxyd"]]


def test_continuations_comments_and_stages():
    dockerfile = parse_dockerfile(
        "# a comment\n"
        "ARG BASE=debian:12\n"
        "FROM ${BASE} AS one\n"
        "RUN apt-get update \\\n"
        "    # a comment inside the continuation\n"
        "\n"
        "    && apt-get install -y --no-install-recommends \\\n"
        "        curl \\\n"
        "        wget\n"
        "from one\n"
        "copy --from=one --chown=1:1 /a /b\n"
    )
    one, final = dockerfile.stages
    assert (one.name, one.base) == ("one", "debian:12")
    assert one.apt_packages() == ["curl", "wget"]
    assert final.base == "one"
    assert final.instructions[0].keyword == "COPY"
    assert final.instructions[0].flags == {"from": "one", "chown": "1:1"}
    assert final.copies() == [("one", ["/a"], "/b")]


@pytest.mark.parametrize(
    ("run", "packages"),
    [
        ("apt-get install -y a b", ["a", "b"]),
        ("DEBIAN_FRONTEND=noninteractive apt-get -q install -y a", ["a"]),
        ("env X=1 apt install a", ["a"]),
        ("/usr/bin/apt-get -o Dpkg::Options::=--force-confold install -t bookworm a", ["a"]),
        ("apt-get update; apt-get install -y a || true && apt-get install -y b a", ["a", "b"]),
        ("apt-get update | tee log", []),
        ("apt-get remove a", []),
        ("echo apt-get install a", []),
        ('["apt-get", "install", "-y", "a"]', ["a"]),
        ("apt-get install -y 'a=1.0'", ["a=1.0"]),
    ],
)
def test_apt_packages(run, packages):
    stage = parse_dockerfile(f"FROM x\nRUN {run}\n").final
    assert stage.apt_packages() == packages


def test_env_forms_and_substitution():
    stage = parse_dockerfile(
        "FROM x\n"
        "ARG V=arg\n"
        "ENV A=1 B=$A\n"  # B sees A from before the instruction
        "ENV C=$A D=${A}x E=${NONE:-dflt} F=${A:+set} G=${NONE:+set}\n"
        "ENV H='$A single' I=\"$A double\" J=a\\ b K=$V\n"
        "ENV L a value with blanks\n"
        "ENV PATH=/new:$PATH\n"
    ).final
    env = stage.env({"PATH": "/bin", "A": "base"})
    assert env == {
        "PATH": "/new:/bin",  # keeps its place
        "A": "1",
        "B": "base",
        "C": "1",
        "D": "1x",
        "E": "dflt",
        "F": "set",
        "G": "",
        "H": "$A single",
        "I": "1 double",
        "J": "a b",
        "K": "arg",
        "L": "a value with blanks",
    }


def test_words():
    assert words("a  'b c' \"d\"e f\\ g", {}) == ["a", "b c", "de", "f g"]
    assert words("''", {}) == [""]
    assert words("$X$Y ${X}", {"X": "1"}) == ["1", "1"]
    assert words("cost $", {}) == ["cost", "$"]


def test_entrypoint_and_cmd_forms():
    stage = parse_dockerfile('FROM x\nCMD ["a"]\nENTRYPOINT run --flag\n').final
    assert stage.entrypoint() == ["/bin/sh", "-c", "run --flag"]
    assert stage.cmd() is None  # ENTRYPOINT resets an earlier CMD
    stage = parse_dockerfile('FROM x\nENTRYPOINT ["a", "b"]\nCMD ["c"]\nUSER 1:2\n').final
    assert (stage.entrypoint(), stage.cmd(), stage.user()) == (["a", "b"], ["c"], "1:2")


@pytest.mark.parametrize(
    "text",
    [
        "RUN echo no FROM\n",
        "",
        "FROM x\nRUN <<EOF\necho\nEOF\n",
        "# escape=`\nFROM x\n",
        "FROM x\nRUN a \\\n",
        "FROM x\nENV A='unterminated\n",
        "FROM x\nENV A=${B/x/y}\n",
        "FROM x\nENV A=1 B\n",
        "FROM x y z\n",
    ],
)
def test_refused(text):
    with pytest.raises(DockerfileError):
        parse_dockerfile(text).final.env({})
