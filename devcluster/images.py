"""Build the project's Dockerfiles without Docker, into the real node's containerd.

One build description: the same `Dockerfile.cpu` and `operator/Dockerfile` that `docker build`
runs on a machine with Docker are executed here instruction by instruction:

- `FROM` maps a base image to a Debian root filesystem made by `debootstrap` (table BASES below;
  `scratch` is empty); `FROM <earlier stage>` continues that stage.
- `RUN` runs in a chroot of the layer stack (an overlay mount), in its own mount and pid namespace
  (`unshare`), so every mount and process of the step disappears with it. Build-time only, not in
  the image: the host's resolv.conf and CA bundle (read-only; registry traffic here is
  TLS-intercepted and only the host's bundle trusts it) and `--mount=type=cache` directories.
- `COPY`/`ADD` (local files, `--from=<stage>`, `--chown`), `ENV`, `ARG`, `WORKDIR`, `USER`,
  `ENTRYPOINT`, `CMD`, `LABEL`, `EXPOSE`, `SHELL`, `HEALTHCHECK` (recorded, like Docker's OCI
  export drops it) follow Docker's meaning.

Every instruction is a layer keyed by its parent's key, its text, the build args it sees and, for
COPY, the content of what it copies (after `.dockerignore`); a key already in the cache is reused,
so a change to rlkube's code rebuilds only the layers from its COPY on. Layers are overlay upper
directories; an export turns each into an OCI tar layer (overlay whiteouts become `.wh.` files)
and `ctr images import` loads the OCI layout into containerd. Cache: `$RLKUBE_CACHE/images`.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .binaries import REPO_ROOT, cache_dir
from .errors import DevClusterError

BUILDER_VERSION = "1"  # bump to invalidate every cached layer when the builder's semantics change
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


@dataclass(frozen=True)
class Base:
    """A Docker Hub base image and the Debian root filesystem standing in for it here."""

    suite: str
    packages: tuple[str, ...]
    note: str


# FROM <image> -> debootstrap --variant=minbase <suite> with these packages. Same Debian release
# and the same interpreter version as the image they stand for; `python` is Debian's 3.11.
BASES: dict[str, Base] = {
    "python:3.11-slim": Base(
        "bookworm",
        ("ca-certificates", "python3", "python3-venv", "python-is-python3", "wget"),
        "Debian bookworm + python3.11 (python, venv); wget for KubeRay's probes",
    ),
    "debian:bookworm-slim": Base("bookworm", ("ca-certificates",), "Debian bookworm"),
}


@dataclass
class Instruction:
    """One Dockerfile instruction: keyword, flags (`--from=x`), and its arguments (raw text)."""

    keyword: str
    flags: dict[str, str]
    args: str
    line: int

    def words(self) -> list[str]:
        """Arguments as a list: JSON (exec) form or whitespace-split."""
        text = self.args.strip()
        if text.startswith("["):
            with contextlib.suppress(ValueError):
                parsed = json.loads(text)
                if isinstance(parsed, list):
                    return [str(p) for p in parsed]
        return shlex.split(text)


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped (no heredocs)."""
    out: list[Instruction] = []
    buf, start = "", 0
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # comment lines inside a continued instruction
        if not buf:
            start = lineno
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, rest = buf.strip().partition(" ")
        flags: dict[str, str] = {}
        rest = rest.strip()
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            name, _, value = flag[2:].partition("=")
            key = name if name != "mount" else f"mount{len([k for k in flags if k.startswith('mount')])}"
            flags[key] = value
            rest = rest.strip()
        out.append(Instruction(keyword.upper(), flags, rest, start))
        buf = ""
    return out


def substitute(text: str, env: dict[str, str]) -> str:
    """`$VAR`, `${VAR}` and `${VAR:-default}` as Docker expands them in instruction arguments."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        default = m.group(3)
        value = env.get(name)
        if default is not None and not value:
            return default
        return value or ""

    return re.sub(r"\$(?:([A-Za-z_][A-Za-z0-9_]*)|\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\})", repl, text)


def _kv_pairs(args: str) -> dict[str, str]:
    """`K=V K2="v 2"` or the legacy `K V` form (ENV, ARG, LABEL)."""
    words = shlex.split(args)
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    out = {}
    for w in words:
        k, _, v = w.partition("=")
        out[k] = v
    return out


# -------------------------------------------------------------------------------------------- ignore


def read_dockerignore(context: Path) -> list[str]:
    path = context / ".dockerignore"
    if not path.is_file():
        return []
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes; `**` spans directories."""
    result = False
    for pat in patterns:
        neg = pat.startswith("!")
        p = pat[1:] if neg else pat
        p = p.strip("/")
        regex = fnmatch.translate(p).replace(".*", "[^/]*").replace("[^/]*[^/]*", ".*")
        regex = regex.replace(r"\*\*", ".*")
        if re.match(regex, rel) or any(
            re.match(regex, "/".join(rel.split("/")[:i])) for i in range(1, rel.count("/") + 1)
        ):
            result = not neg
    return result


def _walk(src: Path, context: Path, patterns: list[str]) -> Iterator[Path]:
    if src.is_file() or src.is_symlink():
        yield src
        return
    for root, dirs, files in os.walk(src):
        rootp = Path(root)
        dirs[:] = sorted(d for d in dirs if not ignored(str((rootp / d).relative_to(context)), patterns))
        for name in sorted(files):
            p = rootp / name
            if not ignored(str(p.relative_to(context)), patterns):
                yield p


def content_key(sources: list[Path], context: Path, patterns: list[str]) -> str:
    """sha256 over every copied file's relative path, mode and content."""
    h = hashlib.sha256()
    for src in sources:
        for p in _walk(src, context, patterns):
            st = p.lstat()
            h.update(f"{p.relative_to(context)}\0{stat.S_IMODE(st.st_mode):o}\0".encode())
            if p.is_symlink():
                h.update(os.readlink(p).encode())
            else:
                with p.open("rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
    return h.hexdigest()


# -------------------------------------------------------------------------------------------- layers


@dataclass
class ImageConfig:
    """What an image's OCI config carries, plus the builder's SHELL."""

    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = ""
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    labels: dict[str, str] = field(default_factory=dict)
    exposed: list[str] = field(default_factory=list)
    shell: list[str] = field(default_factory=lambda: ["/bin/sh", "-c"])
    healthcheck: list[str] | None = None


@dataclass
class Stage:
    name: str
    layers: list[str]  # layer keys, bottom first
    config: ImageConfig
    key: str  # the top key (also for stages with no layers)


class Builder:
    """Runs Dockerfiles into cached layers and exports/imports OCI images."""

    def __init__(self, context: Path = REPO_ROOT, cache: Path | None = None, log: Any = None) -> None:
        self.context = context.resolve()
        self.root = (cache or cache_dir() / "images").resolve()
        self.layers = self.root / "layers"
        self.layers.mkdir(parents=True, exist_ok=True)
        self.log = log or (lambda msg: print(f"[images] {msg}", file=sys.stderr, flush=True))
        self.patterns = read_dockerignore(self.context)
        self.built: list[str] = []
        self.reused: list[str] = []

    # ---------------------------------------------------------------- base

    def _base_layer(self, image: str) -> str:
        base = BASES.get(image)
        if base is None:
            raise DevClusterError(
                f"FROM {image}: no local stand-in (known: {', '.join(sorted(BASES))}, scratch); "
                "add it to rlkube.devcluster.images.BASES"
            )
        mirror = _apt_mirror()
        key = _hash("base", BUILDER_VERSION, base.suite, ",".join(base.packages), mirror)
        layer = self.layers / key
        if (layer / "done").is_file():
            return key
        self.log(f"FROM {image}: debootstrap {base.suite} + {' '.join(base.packages)} (cold, ~2 min)")
        tmp = self.layers / f"{key}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "diff").mkdir(parents=True)
        t0 = time.monotonic()
        argv = [
            "unshare", "--mount", "--propagation", "private",  # its /proc mounts vanish with it
            "debootstrap", "--variant=minbase", f"--include={','.join(base.packages)}",
            base.suite, str(tmp / "diff"), mirror,
        ]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise DevClusterError(f"debootstrap failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        rootfs = tmp / "diff"
        # Docker's slim images carry no apt lists or caches; neither does this one.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        for name in ("etc/resolv.conf", "etc/hosts", "etc/hostname"):
            (rootfs / name).unlink(missing_ok=True)
            (rootfs / name).write_text("")  # mount points for the build; empty in the image
        self._write_meta(tmp, ImageConfig(env={"PATH": DEFAULT_PATH}), f"FROM {image}", time.monotonic() - t0)
        tmp.rename(layer)
        return key

    # ---------------------------------------------------------------- build

    def build(
        self, dockerfile: Path, build_args: dict[str, str] | None = None, target: str | None = None
    ) -> Stage:
        """Build every stage up to `target` (default: the last); returns that stage."""
        text = dockerfile.read_text()
        instructions = parse_dockerfile(text)
        global_args: dict[str, str] = {}
        stages: dict[str, Stage] = {}
        stage: Stage | None = None
        args_given = dict(build_args or {})
        args: dict[str, str] = {}
        for ins in instructions:
            if ins.keyword == "ARG" and stage is None:
                for k, v in _kv_pairs(ins.args).items():
                    global_args[k] = args_given.get(k, substitute(v, global_args))
                continue
            if ins.keyword == "FROM":
                if stage is not None and target and stage.name == target:
                    break
                words = substitute(ins.args, global_args).split()
                image = words[0]
                name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(stages))
                if image in stages:
                    parent = stages[image]
                    stage = Stage(name, list(parent.layers), _copy_config(parent.config), parent.key)
                elif image == "scratch":
                    stage = Stage(name, [], ImageConfig(), _hash("scratch", BUILDER_VERSION))
                else:
                    key = self._base_layer(image)
                    stage = Stage(name, [key], self._read_meta(key), key)
                stages[name] = stage
                args = {}
                continue
            if stage is None:
                raise DevClusterError(f"{dockerfile}:{ins.line}: {ins.keyword} before FROM")
            self._step(stage, ins, args, args_given, global_args, stages, dockerfile)
        if stage is None:
            raise DevClusterError(f"{dockerfile}: no FROM")
        return stage

    def _step(
        self,
        stage: Stage,
        ins: Instruction,
        args: dict[str, str],
        args_given: dict[str, str],
        global_args: dict[str, str],
        stages: dict[str, Stage],
        dockerfile: Path,
    ) -> None:
        cfg = stage.config
        scope = {**args, **cfg.env}
        kw = ins.keyword
        extra = ""
        if kw == "ARG":
            for k, v in _kv_pairs(ins.args).items():
                args[k] = args_given.get(k, global_args.get(k, substitute(v, scope)))
            return  # ARG changes no layer; the RUNs that see it carry it in their key
        if kw == "ENV":
            for k, v in _kv_pairs(ins.args).items():
                cfg.env[k] = substitute(v, scope)
            return self._config_only(stage, ins, json.dumps(cfg.env, sort_keys=True))
        if kw == "LABEL":
            cfg.labels.update({k: substitute(v, scope) for k, v in _kv_pairs(ins.args).items()})
            return self._config_only(stage, ins, "")
        if kw == "EXPOSE":
            cfg.exposed += [p if "/" in p else f"{p}/tcp" for p in substitute(ins.args, scope).split()]
            return self._config_only(stage, ins, "")
        if kw == "USER":
            cfg.user = substitute(ins.args, scope).strip()
            return self._config_only(stage, ins, cfg.user)
        if kw in ("ENTRYPOINT", "CMD"):
            words = ins.words()
            if not ins.args.strip().startswith("["):
                words = [*cfg.shell, ins.args.strip()]
            if kw == "ENTRYPOINT":
                cfg.entrypoint, cfg.cmd = words, None
            else:
                cfg.cmd = words
            return self._config_only(stage, ins, "")
        if kw == "SHELL":
            cfg.shell = ins.words()
            return self._config_only(stage, ins, "")
        if kw == "HEALTHCHECK":
            cfg.healthcheck = [ins.args]
            return self._config_only(stage, ins, "")
        if kw == "WORKDIR":
            path = substitute(ins.args.strip(), scope)
            cfg.workdir = path if path.startswith("/") else str(Path(cfg.workdir) / path)
            script = f"mkdir -p {shlex.quote('@MERGED@' + cfg.workdir)}"
            return self._layer(stage, ins, script, extra=cfg.workdir)
        if kw in ("COPY", "ADD"):
            words = [substitute(w, scope) for w in ins.words()]
            *srcs, dest = words
            if not dest.startswith("/"):
                dest = str(Path(cfg.workdir) / dest) + ("/" if dest.endswith("/") else "")
            chown = substitute(ins.flags.get("chown", ""), scope)
            from_stage = ins.flags.get("from")
            if from_stage:
                if from_stage not in stages:
                    raise DevClusterError(f"{dockerfile}:{ins.line}: COPY --from={from_stage}: no such stage")
                src_stage = stages[from_stage]
                extra = f"from={src_stage.key}"
                script = self._copy_script([("@FROM@" + s) for s in srcs], dest, chown, many=len(srcs) > 1)
                return self._layer(stage, ins, script, extra=extra, from_stage=src_stage)
            paths = []
            for s in srcs:
                matches = sorted(self.context.glob(s)) if any(c in s for c in "*?[") else [self.context / s]
                for m in matches:
                    if not m.exists():
                        raise DevClusterError(
                            f"{dockerfile}:{ins.line}: {kw} {s}: not in the context {self.context}"
                        )
                    paths.append(m)
            extra = content_key(paths, self.context, self.patterns)
            staged = self.root / "context" / extra
            if not staged.exists():  # the copied files, .dockerignore applied, in one place
                tmp = staged.with_suffix(".tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                for src in paths:
                    for p in _walk(src, self.context, self.patterns):
                        rel = p.relative_to(self.context)
                        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(p, tmp / rel, follow_symlinks=False)
                tmp.mkdir(parents=True, exist_ok=True)
                tmp.rename(staged)
            rels = [str(p.relative_to(self.context)) for p in paths]
            script = self._copy_script([f"@CTX@/{r}" for r in rels], dest, chown, many=len(rels) > 1)
            return self._layer(stage, ins, script, extra=extra, context_dir=staged)
        if kw == "RUN":
            env = {**args, **cfg.env}
            # Shell form: the shell expands variables, as in Docker.
            argv = ins.words() if ins.args.strip().startswith("[") else [*cfg.shell, ins.args]
            mounts = [v for k, v in ins.flags.items() if k.startswith("mount")]
            extra = json.dumps([sorted(env.items()), argv, mounts, cfg.user, cfg.workdir])
            return self._layer(stage, ins, None, extra=extra, run=(argv, env, mounts))
        raise DevClusterError(f"{dockerfile}:{ins.line}: {kw} is not supported by the local builder")

    @staticmethod
    def _copy_script(srcs: list[str], dest: str, chown: str, many: bool) -> str:
        """Docker's COPY: a directory's contents go into dest; several sources (or dest/) mean a
        directory. Files belong to root unless --chown (then the whole dest is chowned)."""
        d = "@MERGED@" + dest
        dir_dest = dest.endswith("/") or many
        lines = ["set -e", f"mkdir -p {shlex.quote(d if dir_dest else str(Path(d).parent))}"]
        for s in srcs:
            q, qd = shlex.quote(s), shlex.quote(d)
            if dir_dest:
                lines.append(
                    f"if [ -d {q} ] && [ ! -L {q} ]; then cp -a {q}/. {qd}/; else cp -a {q} {qd}/; fi"
                )
            else:
                lines.append(
                    f"if [ -d {q} ] && [ ! -L {q} ]; then mkdir -p {qd} && cp -a {q}/. {qd}/; "
                    f"else cp -a {q} {qd}; fi"
                )
        if chown:
            owner = chown if ":" in chown else f"{chown}:{chown}"
            lines.append(f"chroot @MERGED@ chown -R {shlex.quote(owner)} {shlex.quote(dest)}")
        return "\n".join(lines)

    def _config_only(self, stage: Stage, ins: Instruction, extra: str) -> None:
        key = _hash(
            stage.key, ins.keyword, ins.args, extra, json.dumps(_cfg_dict(stage.config), sort_keys=True)
        )
        stage.key = key

    def _layer(
        self,
        stage: Stage,
        ins: Instruction,
        script: str | None,
        *,
        extra: str = "",
        run: tuple[list[str], dict[str, str], list[str]] | None = None,
        context_dir: Path | None = None,
        from_stage: Stage | None = None,
    ) -> None:
        key = _hash(
            stage.key, BUILDER_VERSION, ins.keyword, json.dumps(ins.flags, sort_keys=True), ins.args, extra
        )
        layer = self.layers / key
        label = f"{ins.keyword} {ins.args[:90]}"
        if (layer / "done").is_file():
            self.reused.append(label)
        else:
            tmp = self.layers / f"{key}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "diff").mkdir(parents=True)
            (tmp / "work").mkdir()
            t0 = time.monotonic()
            self.log(f"step {label}")
            self._execute(stage, tmp, script, run, context_dir, from_stage)
            shutil.rmtree(tmp / "work", ignore_errors=True)
            self._write_meta(tmp, stage.config, label, time.monotonic() - t0)
            tmp.rename(layer)
            self.built.append(label)
            self.log(f"  done in {time.monotonic() - t0:.1f} s")
        stage.layers.append(key)
        stage.key = key

    def _lowerdirs(self, layers: list[str]) -> str:
        dirs = [str(self.layers / k / "diff") for k in reversed(layers)]
        dirs = [d for d in dirs if any(Path(d).iterdir())]
        if not dirs:
            empty = self.root / "empty"
            empty.mkdir(exist_ok=True)
            dirs = [str(empty)]
        return ":".join(dirs)

    def _execute(
        self,
        stage: Stage,
        tmp: Path,
        script: str | None,
        run: tuple[list[str], dict[str, str], list[str]] | None,
        context_dir: Path | None,
        from_stage: Stage | None,
    ) -> None:
        """Mount the stack and run the step inside a private mount + pid namespace."""
        ns = tmp / "ns"
        for sub in ("merged", "src", "ctx"):
            (ns / sub).mkdir(parents=True, exist_ok=True)
        sh = ["set -e", "mount --make-rprivate /"]
        sh.append(
            f"mount -t overlay overlay -o lowerdir={self._lowerdirs(stage.layers)},"
            f"upperdir={tmp / 'diff'},workdir={tmp / 'work'} {ns / 'merged'}"
        )
        prelude = [f"M={shlex.quote(str(ns / 'merged'))}"]
        if from_stage is not None:
            sh.append(
                f"mount -t overlay overlay -o ro,lowerdir={self._lowerdirs(from_stage.layers)} {ns / 'src'}"
            )
        if context_dir is not None:
            sh.append(f"mount --bind -o ro {context_dir} {ns / 'ctx'}")
        body: list[str] = []
        if script is not None:
            body.append(
                script.replace("@MERGED@", "$M")
                .replace("@FROM@", str(ns / "src"))
                .replace("@CTX@", str(ns / "ctx"))
            )
        if run is not None:
            argv, env, mounts = run
            body.append(self._run_script(stage, argv, env, mounts))
        full = "\n".join([*prelude, *sh, *body])
        (tmp / "step.sh").write_text(full + "\n")
        log_path = tmp / "step.log"
        with log_path.open("wb") as out:
            proc = subprocess.run(
                [
                    "unshare",
                    "--mount",
                    "--pid",
                    "--fork",
                    "--propagation",
                    "private",
                    "bash",
                    str(tmp / "step.sh"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={"PATH": os.environ.get("PATH", DEFAULT_PATH), "LANG": "C.UTF-8"},
            )
        if proc.returncode != 0:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
            raise DevClusterError(
                f"build step failed (exit {proc.returncode}); last lines of {log_path}:\n{tail}"
            )
        shutil.rmtree(ns, ignore_errors=True)

    def _run_script(self, stage: Stage, argv: list[str], env: dict[str, str], mounts: list[str]) -> str:
        cfg = stage.config
        lines = [
            "mount -t proc proc $M/proc",
            "mount -t sysfs -o ro sysfs $M/sys",
            "mount -t tmpfs -o mode=755 tmpfs $M/dev",
            "for d in null zero full random urandom tty; do",
            "  touch $M/dev/$d; mount --bind /dev/$d $M/dev/$d",
            "done",
            "mkdir -p $M/dev/shm $M/dev/pts && mount -t tmpfs tmpfs $M/dev/shm",
            "ln -s /proc/self/fd $M/dev/fd; ln -s /proc/self/fd/0 $M/dev/stdin",
            "ln -s /proc/self/fd/1 $M/dev/stdout; ln -s /proc/self/fd/2 $M/dev/stderr",
            "mount -t tmpfs tmpfs $M/tmp 2>/dev/null || true",
        ]
        for name, host in (("etc/resolv.conf", "/etc/resolv.conf"), ("etc/hosts", "/etc/hosts")):
            lines.append(f"[ -e $M/{name} ] || touch $M/{name}")
            lines.append(f"mount --bind -o ro {host} $M/{name} && mount -o remount,bind,ro $M/{name}")
        if HOST_CA_BUNDLE.is_file():
            ca = "etc/ssl/certs/ca-certificates.crt"
            lines.append(
                f"if [ -e $M/{ca} ]; then mount --bind {HOST_CA_BUNDLE} $M/{ca} "
                f"&& mount -o remount,bind,ro $M/{ca}; fi"
            )
        for spec in mounts:
            opts = dict(p.partition("=")[::2] for p in spec.split(","))
            if opts.get("type") != "cache":
                raise DevClusterError(f"RUN --mount={spec}: only type=cache is supported locally")
            target = opts.get("target") or opts.get("dst") or opts.get("destination", "")
            host_dir = self._cache_mount(opts.get("id") or target)
            lines.append(
                f"mkdir -p $M{shlex.quote(target)} "
                f"&& mount --bind {shlex.quote(str(host_dir))} $M{shlex.quote(target)}"
            )
        user = cfg.user or "0"
        build_env = {
            "HOME": "/root" if user in ("0", "root", "") else "/tmp",
            "PATH": DEFAULT_PATH,
            **env,
            # Build-time only (not in the image): trust the host's CA bundle, which is the one
            # that trusts this machine's TLS-intercepted registry traffic.
            "PIP_CERT": "/etc/ssl/certs/ca-certificates.crt",
            "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
            "REQUESTS_CA_BUNDLE": "/etc/ssl/certs/ca-certificates.crt",
            "DEBIAN_FRONTEND": "noninteractive",
        }
        env_args = " ".join(shlex.quote(f"{k}={v}") for k, v in build_env.items())
        userspec = "" if user in ("0", "root", "0:0") else f"--userspec={shlex.quote(user)} "
        inner = " ".join(shlex.quote(a) for a in argv)
        lines.append(
            f"cd $M && exec chroot {userspec}$M /usr/bin/env -i {env_args} "
            f"/bin/sh -c {shlex.quote('cd ' + shlex.quote(cfg.workdir) + ' && exec ' + inner)}"
        )
        return "\n".join(lines)

    def _cache_mount(self, ident: str) -> Path:
        """Host directory behind `RUN --mount=type=cache,id=...`: uv's and pip's caches are shared
        with this machine's own (same wheels, no second download), anything else gets its own."""
        if ident in ("uv", "/root/.cache/uv"):
            host = Path(os.environ.get("UV_CACHE_DIR", str(Path.home() / ".cache" / "uv")))
        else:
            host = self.root / "cache" / _hash(ident)[:16]
        host.mkdir(parents=True, exist_ok=True)
        return host

    # ---------------------------------------------------------------- meta

    def _write_meta(self, layer_dir: Path, cfg: ImageConfig, label: str, seconds: float) -> None:
        (layer_dir / "meta.json").write_text(
            json.dumps({"config": _cfg_dict(cfg), "created_by": label, "seconds": round(seconds, 1)})
        )
        (layer_dir / "done").write_text("")

    def _read_meta(self, key: str) -> ImageConfig:
        meta = json.loads((self.layers / key / "meta.json").read_text())
        return ImageConfig(**meta["config"])

    # ---------------------------------------------------------------- export

    def layer_tar(self, key: str) -> tuple[Path, str, int] | None:
        """The OCI tar of one layer (cached next to it): (path, sha256 digest, size); None if empty."""
        layer = self.layers / key
        diff = layer / "diff"
        if not any(diff.iterdir()):
            return None
        tar_path, info = layer / "layer.tar", layer / "layer.json"
        if info.is_file() and tar_path.is_file():
            meta = json.loads(info.read_text())
            return tar_path, meta["digest"], meta["size"]
        tmp = tar_path.with_suffix(".tmp")
        with tmp.open("wb") as raw:
            hasher = _HashingWriter(raw)
            with tarfile.open(fileobj=hasher, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                _add_overlay_dir(tar, diff)
        digest = "sha256:" + hasher.hash.hexdigest()
        tmp.rename(tar_path)
        info.write_text(json.dumps({"digest": digest, "size": hasher.size}))
        return tar_path, digest, hasher.size

    def export(self, stage: Stage, name: str) -> Path:
        """Write the OCI layout for `stage` tagged `name`; returns the layout directory."""
        cfg = stage.config
        layers = [t for k in stage.layers if (t := self.layer_tar(k)) is not None]
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Env": [f"{k}={v}" for k, v in cfg.env.items()],
                "WorkingDir": cfg.workdir,
                **({"User": cfg.user} if cfg.user else {}),
                **({"Entrypoint": cfg.entrypoint} if cfg.entrypoint else {}),
                **({"Cmd": cfg.cmd} if cfg.cmd else {}),
                **({"Labels": cfg.labels} if cfg.labels else {}),
                **({"ExposedPorts": {p: {} for p in cfg.exposed}} if cfg.exposed else {}),
            },
            "rootfs": {"type": "layers", "diff_ids": [d for _, d, _ in layers]},
        }
        out = self.root / "oci" / _hash(name, stage.key)[:16]
        blobs = out / "blobs" / "sha256"
        blobs.mkdir(parents=True, exist_ok=True)
        for path, digest, _ in layers:
            target = blobs / digest.split(":", 1)[1]
            if not target.exists():
                os.link(path, target)
        config_digest = _put_blob(blobs, json.dumps(config, sort_keys=True).encode())
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest[0],
                "size": config_digest[1],
            },
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": s}
                for _, d, s in layers
            ],
        }
        m_digest, m_size = _put_blob(blobs, json.dumps(manifest, sort_keys=True).encode())
        full = _full_name(name)
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": m_digest,
                    "size": m_size,
                    "annotations": {
                        "io.containerd.image.name": full,
                        "org.opencontainers.image.ref.name": full,
                    },
                }
            ],
        }
        (out / "index.json").write_text(json.dumps(index))
        (out / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
        (out / "manifest-digest").write_text(m_digest)
        return out


DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class _HashingWriter(io.RawIOBase):
    def __init__(self, raw: Any) -> None:
        self.raw, self.hash, self.size = raw, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.hash.update(b)
        self.size += len(b)
        self.raw.write(b)
        return len(b)


def _add_overlay_dir(tar: tarfile.TarFile, diff: Path) -> None:
    """Add an overlay upper dir as an OCI layer: whiteouts (0/0 char devices) -> `.wh.<name>`,
    opaque directories -> `.wh..wh..opq`."""
    for root, dirs, files in os.walk(diff):
        rootp = Path(root)
        dirs.sort()
        rel_root = rootp.relative_to(diff)
        if rootp != diff:
            try:
                opaque = os.getxattr(rootp, "trusted.overlay.opaque") == b"y"
            except OSError:
                opaque = False
            if opaque:
                info = tarfile.TarInfo(str(rel_root / ".wh..wh..opq"))
                tar.addfile(info, io.BytesIO(b""))
        for name in [*dirs, *sorted(files)]:
            p = rootp / name
            rel = str(rel_root / name) if str(rel_root) != "." else name
            st = p.lstat()
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                info = tarfile.TarInfo(str(Path(rel).parent / f".wh.{name}") if "/" in rel else f".wh.{name}")
                tar.addfile(info, io.BytesIO(b""))
                continue
            if stat.S_ISSOCK(st.st_mode):
                continue
            info = tar.gettarinfo(str(p), arcname=rel)
            info.mtime = int(st.st_mtime)
            if info.isreg():
                with p.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)


def _put_blob(blobs: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


def _full_name(name: str) -> str:
    """`rlkube/runtime-cpu:0.1.0` -> `docker.io/rlkube/runtime-cpu:0.1.0` (what the kubelet asks for)."""
    first = name.split("/", 1)[0]
    if "/" not in name:
        name = f"library/{name}"
        first = "library"
    if "." not in first and ":" not in first and first != "localhost":
        name = f"docker.io/{name}"
    return name


def _hash(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _copy_config(cfg: ImageConfig) -> ImageConfig:
    return ImageConfig(**json.loads(json.dumps(_cfg_dict(cfg))))


def _cfg_dict(cfg: ImageConfig) -> dict[str, Any]:
    return {
        "env": cfg.env,
        "workdir": cfg.workdir,
        "user": cfg.user,
        "entrypoint": cfg.entrypoint,
        "cmd": cfg.cmd,
        "labels": cfg.labels,
        "exposed": cfg.exposed,
        "shell": cfg.shell,
        "healthcheck": cfg.healthcheck,
    }


def _apt_mirror() -> str:
    """The Debian mirror this machine's apt uses (debootstrap needs the same one)."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        with contextlib.suppress(OSError):
            text = path.read_text()
            m = re.search(r"^URIs:\s*(\S+/debian)\s*$", text, re.M) or re.search(
                r"^deb\s+(?:\[[^]]*\]\s+)?(\S+/debian)\s+bookworm", text, re.M
            )
            if m:
                return m.group(1)
    return "http://deb.debian.org/debian"


# ------------------------------------------------------------------------------------------ images


@dataclass(frozen=True)
class ImageSpec:
    name: str
    dockerfile: str
    build_args: tuple[tuple[str, str], ...] = ()


PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
IMAGES = {
    "runtime-cpu": ImageSpec("rlkube/runtime-cpu:0.1.0", "Dockerfile.cpu"),
    "operator": ImageSpec("rlkube/operator:0.1.0", "operator/Dockerfile"),
}


def pause_layout(pause_binary: Path, cache: Path | None = None) -> Path:
    """The sandbox image: one static `pause` binary (what upstream's FROM scratch image holds)."""
    root = (cache or cache_dir() / "images") / "pause"
    data = pause_binary.read_bytes()
    key = hashlib.sha256(data).hexdigest()[:16]
    out = root / key
    if (out / "index.json").is_file():
        return out
    tmp = root / f"{key}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    blobs = tmp / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("pause")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
    layer = _put_blob(blobs, buf.getvalue())
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [layer[0]]},
    }
    cfg = _put_blob(blobs, json.dumps(config).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg[0], "size": cfg[1]},
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer[0], "size": layer[1]}
        ],
    }
    m = _put_blob(blobs, json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": m[0],
                "size": m[1],
                "annotations": {
                    "io.containerd.image.name": PAUSE_IMAGE,
                    "org.opencontainers.image.ref.name": PAUSE_IMAGE,
                },
            }
        ],
    }
    (tmp / "index.json").write_text(json.dumps(index))
    (tmp / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (tmp / "manifest-digest").write_text(m[0])
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def import_layout(layout: Path, ctr: list[str], attempts: int = 3) -> bool:
    """Stream the OCI layout as an archive into `ctr ... images import -`; False if already there.

    Retried (up to `attempts` in all) when containerd's unpack loses a snapshot it had just found:
    replacing an image tag lets its garbage collector remove the old image's unreferenced
    snapshots while the new import is stacking layers on them ("parent snapshot ... does not
    exist"); a retry streams every blob and unpacks the chain afresh."""
    digest = (layout / "manifest-digest").read_text().strip()
    index = json.loads((layout / "index.json").read_text())
    name = index["manifests"][0]["annotations"]["io.containerd.image.name"]
    listed = subprocess.run(
        [*ctr, "images", "ls", f"name=={name}"], capture_output=True, text=True, timeout=60
    )
    if digest in listed.stdout:
        return False
    errors: list[str] = []
    for attempt in range(attempts):
        out, ok = _stream_import(layout, ctr, skip_held=attempt == 0)
        if ok:
            return True
        errors.append(out[-2000:])
        if not _RETRYABLE_IMPORT.search(out) or attempt == attempts - 1:
            break
        time.sleep(1.0 + attempt)
    raise DevClusterError(f"ctr images import of {name} failed ({len(errors)} attempt(s)): {errors[-1]}")


# What containerd prints when a concurrent garbage collection or a half-finished earlier unpack
# left the snapshot or content chain short; anything else (a corrupt layout) fails at once.
_RETRYABLE_IMPORT = re.compile(r"snapshot \S+ does not exist|not found|already exists", re.I)


def _stream_import(layout: Path, ctr: list[str], skip_held: bool) -> tuple[str, bool]:
    """One `ctr images import -`: returns its output and whether it succeeded.

    With `skip_held`, blobs containerd already holds (the unchanged layers of an earlier build)
    are not streamed again: the import reads them from its content store, so a code change
    imports in seconds."""
    have: set[str] = set()
    if skip_held:
        held = subprocess.run([*ctr, "content", "ls", "-q"], capture_output=True, text=True, timeout=60)
        have = set(held.stdout.split()) if held.returncode == 0 else set()
    proc = subprocess.Popen([*ctr, "images", "import", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # fmt: skip
    assert proc.stdin is not None
    try:
        with tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for p in sorted(layout.rglob("*")):
                if p.name == "manifest-digest" or (p.parent.name == "sha256" and f"sha256:{p.name}" in have):
                    continue
                tar.add(str(p), arcname=str(p.relative_to(layout)), recursive=False)
    except BrokenPipeError:
        pass  # ctr exited early; its output says why
    finally:
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
    out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    return out, proc.wait() == 0


def build_image(which: str, builder: Builder | None = None) -> tuple[Path, Builder]:
    """Build one of IMAGES (cached) and export it; returns the OCI layout and the builder."""
    spec = IMAGES[which]
    b = builder or Builder()
    stage = b.build(REPO_ROOT / spec.dockerfile, dict(spec.build_args))
    return b.export(stage, spec.name), b


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rlkube.devcluster.images", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "images", nargs="*", default=list(IMAGES), help=f"which (default all): {', '.join(IMAGES)}"
    )
    args = p.parse_args(argv)
    for which in args.images:
        t0 = time.monotonic()
        layout, b = build_image(which)
        print(
            f"[images] {IMAGES[which].name}: {len(b.built)} layers built, {len(b.reused)} reused, "
            f"{time.monotonic() - t0:.1f} s -> {layout}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
