"""Read the deployment files the way their consumers do: the Dockerfile's stages, k8s/ YAML documents,
the build context that .dockerignore lets through, Kubernetes quantities.

The Dockerfile is parsed with ``dockerfile-parse`` (line continuations, comments, stages); what a
stage's instructions *mean* (exec-form JSON, HEALTHCHECK options, COPY sources) is read here.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import yaml
from docker.utils.build import exclude_paths
from dockerfile_parse import DockerfileParser

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
K8S = REPO / "k8s"
RUNTIME_SPEC = K8S / "etl-spec.yaml"
STANDALONE = K8S / "standalone"
SERVER_LOCK = REPO / "requirements" / "server.txt"
TORCH_LOCK = REPO / "requirements" / "torch.txt"


@dataclass
class Instruction:
    name: str  # upper case: RUN, COPY, ENV, ...
    value: str
    line: int  # 1-based, for messages

    def flags_and_rest(self) -> tuple[dict[str, str], str]:
        """Leading ``--flag=value`` options (RUN --mount, COPY --from, HEALTHCHECK --interval) and the rest."""
        flags: dict[str, str] = {}
        rest = self.value.strip()
        while rest.startswith("--"):
            token, _, rest = rest.partition(" ")
            key, _, value = token[2:].partition("=")
            flags[key] = value
            rest = rest.lstrip()
        return flags, rest


def env_items(instruction: Instruction) -> dict[str, str]:
    result = {}
    for item in shlex.split(instruction.value):
        key, sep, value = item.partition("=")
        assert sep, f"Dockerfile:{instruction.line}: use ENV KEY=value, not the legacy 'ENV KEY value'"
        result[key] = value
    return result


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, name: str) -> list[Instruction]:
        return [i for i in self.instructions if i.name == name]

    def last(self, name: str) -> Instruction:
        found = self.all(name)
        assert found, f"stage {self.name or self.base} has no {name}"
        return found[-1]

    def env(self) -> dict[str, str]:
        """ENV of this stage, in order (``$VAR`` references are left as written)."""
        result: dict[str, str] = {}
        for instruction in self.all("ENV"):
            result.update(env_items(instruction))
        return result

    def exec_form(self, name: str) -> list[str]:
        """ENTRYPOINT / CMD as an argv; the shell form would put /bin/sh in front and eat SIGTERM."""
        instruction = self.last(name)
        argv = json.loads(instruction.value)
        assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), (
            f"Dockerfile:{instruction.line}: {name} must be the JSON exec form"
        )
        return argv

    def healthcheck(self) -> tuple[dict[str, str], list[str]]:
        flags, rest = self.last("HEALTHCHECK").flags_and_rest()
        assert rest.startswith("CMD "), f"HEALTHCHECK must be 'CMD [...]', got {rest!r}"
        return flags, json.loads(rest[4:])


@dataclass
class Dockerfile:
    args: dict[str, str]  # global ARG defaults (before the first FROM) and stage ARGs with defaults
    stages: list[Stage]

    @classmethod
    def load(cls, path: Path = DOCKERFILE) -> Dockerfile:
        parser = DockerfileParser(path=str(path))
        args: dict[str, str] = {}
        stages: list[Stage] = []
        for item in parser.structure:
            name, value, line = item["instruction"], item["value"], item["startline"] + 1
            if name == "COMMENT":
                continue
            if name == "FROM":
                image, _, alias = value.partition(" AS ") if " AS " in value else value.partition(" as ")
                stages.append(Stage(base=image.strip(), name=alias.strip() or None))
                continue
            if name == "ARG" and "=" in value:
                key, _, default = value.partition("=")
                args[key.strip()] = default.strip().strip('"')
            if stages:
                stages[-1].instructions.append(Instruction(name, value, line))
        return cls(args=args, stages=stages)

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def expand(self, text: str) -> str:
        """``${ARG}`` / ``$ARG`` replaced by the ARG defaults, which may name earlier ARGs (how ``docker build``
        resolves FROM lines)."""
        for _ in range(len(self.args) + 1):
            expanded = re.sub(r"\$\{?(\w+)\}?", lambda m: self.args.get(m.group(1), m.group(0)), text)
            if expanded == text:
                return text
            text = expanded
        raise ValueError(f"ARG defaults refer to each other in a loop: {text}")

    def chain(self, stage: Stage) -> list[Stage]:
        """The stages ``stage`` is built on, first to last, itself included."""
        names = {s.name: s for s in self.stages if s.name}
        chain = [stage]
        while chain[0].base in names:
            chain.insert(0, names[chain[0].base])
        return chain

    def image_env(self) -> dict[str, str]:
        """The final image's ENV: every ENV of the stages it is built on, in order."""
        env: dict[str, str] = {}
        for stage in self.chain(self.final):
            env.update(stage.env())
        return env

    def base_of(self, stage: Stage) -> str:
        """The image a stage starts from, following ``FROM <earlier stage>`` to its first stage's image."""
        return self.expand(self.chain(stage)[0].base)


def yaml_documents(path: Path) -> list[dict]:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def k8s_yaml_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml"))


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def build_context(destination: Path) -> Path:
    """Copy what ``docker build .`` would send (the repository minus .dockerignore) to ``destination``.

    docker-py's ``exclude_paths`` implements Docker's .dockerignore rules (``**``, ``!`` exceptions);
    re-implementing them here would be a second, unchecked copy of Go's matcher.
    """
    for relative in sorted(exclude_paths(str(REPO), dockerignore_patterns())):
        source = REPO / relative
        if source.is_file():
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


_CPU = re.compile(r"^(\d+(?:\.\d+)?)(m?)$")
_BYTES = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_BYTE_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
               "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def cpu_cores(quantity: str | int | float) -> Decimal:
    """A Kubernetes CPU quantity ("4", "500m") in cores. Only the forms these manifests may use; the
    schema check (kubernetes-validate) already rejects malformed ones."""
    match = _CPU.match(str(quantity))
    assert match, f"CPU quantity {quantity!r}: use whole cores like \"4\" or millicores like \"500m\""
    value = Decimal(match.group(1))
    return value / 1000 if match.group(2) else value


def memory_bytes(quantity: str | int) -> int:
    match = _BYTES.match(str(quantity))
    assert match, f"memory quantity {quantity!r}: use a number with Ki/Mi/Gi or k/M/G"
    return int(Decimal(match.group(1)) * _BYTE_UNITS[match.group(2)])
