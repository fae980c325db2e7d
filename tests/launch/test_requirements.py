"""Requirements from the store: a requirements.txt in --workdir (or --requirements FILE) is read at `fab train`
time; a pin that would change the nodes' torch or transformers is refused in one line before anything starts; the
wheels the nodes lack are downloaded here for their platform into the store's wheels/<key>/ (once per key); every
node installs them from there into the run's layer on the ranks' PYTHONPATH.

The packages are wheels built here (pure Python, no index needed): pip reads only the test's own folder. The run
on the session's 2-node local cluster (marked `cluster`) is the done-when: the package imports on every rank.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import uuid
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from core.errors import ClusterError
from core.render import render
from launch.life import records
from launch.plan.request import TrainRequest
from launch.staging import requirements as rq
from launch.supervision import train_flags
from node_setup import profiles
from training.runtime import pylayer
from training.runtime.store import STORE_ENV, open_store

FIX = "remove the pin (the profile's torch and transformers win)"


def wheel(folder: Path, name: str, version: str, deps: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel: module <name with underscores> whose __version__ is `version`."""
    dist, module = name.replace("-", "_"), name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {f"{module}/__init__.py": f"__version__ = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {d}\n" for d in deps),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(b.encode()).digest()).rstrip(b'=').decode()},"
                     f"{len(b.encode())}\n" for p, b in files.items()) + f"{info}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for p, body in {**files, f"{info}/RECORD": record}.items():
            zf.writestr(p, body)
    return path


def sdist(folder: Path, name: str, version: str) -> Path:
    src = folder / "src" / f"{name}-{version}"
    src.mkdir(parents=True)
    (src / "PKG-INFO").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    path = folder / f"{name}-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(src, arcname=src.name)
    return path


@pytest.fixture
def links(tmp_path, monkeypatch) -> SimpleNamespace:
    """pip's only source: a folder of wheels (one with a dependency, one needing an old torch) and an sdist."""
    folder = tmp_path / "links"
    tag = uuid.uuid4().hex[:6]  # names no venv has
    wheel(folder, f"xchello{tag}", "1.2", (f"xchellodep{tag}>=0.2", 'never-installed; python_version < "3"'))
    wheel(folder, f"xchellodep{tag}", "0.3")
    wheel(folder, f"xcold{tag}", "1.0", ("torch<2",))
    sdist(folder, f"xcsource{tag}", "1.0")
    for key, value in pip_env(folder).items():
        monkeypatch.setenv(key, value)
    return SimpleNamespace(folder=folder, tag=tag)


def pip_env(folder: Path) -> dict[str, str]:
    return {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(folder)}


def here_software(marker: str = "") -> rq.NodeSoftware:
    """This machine's venv as a node's (the local cluster's), or with a profile's marker."""
    facts = json.loads(subprocess.run([sys.executable, "-c", pylayer.PROBE_PY, "no-marker"], capture_output=True, text=True,
                                      check=True).stdout)
    return rq.software({**facts, "marker": marker}, local=not marker)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ---- reading the file ------------------------------------------------------------------------------------------

def test_the_file_is_read_as_pip_reads_it(tmp_path):
    write(tmp_path / "more.txt", "humanize>=4  # a comment\n")
    path = write(tmp_path / "requirements.txt", "# top\n\ntabulate==0.9.0 \\\n    --hash=sha256:abc\n-r more.txt\n"
                 "termcolor[x] ; python_version >= '3.8'\n")
    lines = rq.parse(path)
    assert [str(line.req) for line in lines] == ["tabulate==0.9.0", "humanize>=4",
                                                   'termcolor[x]; python_version >= "3.8"']
    assert [line.where for line in lines] == ["requirements.txt line 3", "requirements.txt -> more.txt line 1",
                                              "requirements.txt line 6"]


@pytest.mark.parametrize("text, what", [
    ("--extra-index-url https://example.org/simple\n", ("requirements.txt line 1: the pip option --extra-index-url is "
     "not read; list package requirements only")),
    ("-e .\n", "requirements.txt line 1: the pip option -e is not read"),
    ("pkg @ https://example.org/pkg.whl\n", ("requirements.txt line 1: pkg @ https://example.org/pkg.whl is a direct "
     "reference; name a released version")),
    ("ok\nnot a requirement!\n", "requirements.txt line 2: 'not a requirement!' is not a requirement ("),
    ("-r missing.txt\n", "requirements.txt line 1: -r missing.txt names no file next to it"),
])
def test_what_pip_options_and_bad_lines_are_refused_in_one_line(tmp_path, text, what):
    with pytest.raises(ClusterError) as exc:
        rq.parse(write(tmp_path / "requirements.txt", text))
    assert str(exc.value).startswith(what) and "\n" not in str(exc.value)


def test_the_file_is_the_flag_or_the_workdirs_own(tmp_path):
    assert rq.find(None, str(tmp_path)) is None
    own = write(tmp_path / "requirements.txt", "x\n")
    assert rq.find(None, str(tmp_path)) == own
    other = write(tmp_path / "deps" / "train.txt", "y\n")
    assert rq.find(str(other), str(tmp_path)) == other
    with pytest.raises(ClusterError, match=r"^--requirements /nope.txt does not exist; "):
        rq.find("/nope.txt", None)


# ---- what wins -----------------------------------------------------------------------------------------------------

def test_a_pin_of_another_torch_is_refused_naming_both_versions(tmp_path):
    """The done-when's refusal, without a cluster: the nodes' profile (by its marker) or this machine's venv."""
    upstream = profiles.load_profile("upstream")
    sw = here_software(marker=upstream.hash)
    assert sw.profile is not None and sw.profile.name == "upstream"
    torch, transformers = upstream.version_of("torch"), upstream.version_of("transformers")
    with pytest.raises(ClusterError) as exc:
        rq.check_pins(rq.parse(write(tmp_path / "requirements.txt", "tabulate\ntorch==2.5.0\n")), sw, "requirements.txt")
    assert str(exc.value) == f"requirements.txt pins torch==2.5.0, but the nodes' profile upstream has torch {torch}; {FIX}"
    with pytest.raises(ClusterError) as exc:
        rq.check_pins(rq.parse(write(tmp_path / "r.txt", "transformers<5\n")), sw, "r.txt")
    assert str(exc.value) == f"r.txt pins transformers<5, but the nodes' profile upstream has transformers {transformers}; {FIX}"
    rq.check_pins(rq.parse(write(tmp_path / "ok.txt", f"torch>=2\ntorch=={torch.split('+')[0]}\ntransformers\n")), sw,
                  "ok.txt")  # what the nodes have fits: nothing to refuse
    local = here_software()
    with pytest.raises(ClusterError, match=r"^requirements.txt pins torch==2.5.0, but the local cluster's nodes \(this "
                       r"machine's venv\) have torch \S+; remove the pin"):
        rq.check_pins(rq.parse(tmp_path / "requirements.txt"), local, "requirements.txt")


def test_prepare_refuses_before_anything_reaches_the_store(tmp_path, monkeypatch):
    store = tmp_path / "store"
    write(tmp_path / "proj" / "requirements.txt", "torch==2.5.0\n")
    monkeypatch.setattr(rq, "node_software", lambda cluster: here_software())
    req = TrainRequest.of(workdir=str(tmp_path / "proj"), script="train.py", env={STORE_ENV: store.as_uri()})
    said = []
    with pytest.raises(ClusterError, match=r"^requirements.txt pins torch==2.5.0, but "):
        rq.prepare(req, SimpleNamespace(is_local=True), said.append)
    assert said == [] and not store.exists()


# ---- the wheels ---------------------------------------------------------------------------------------------------

def test_the_wheels_the_nodes_lack_go_to_the_store_once(tmp_path, links, monkeypatch):
    tag = links.tag
    store = tmp_path / "store"
    write(tmp_path / "proj" / "requirements.txt", f"xchello{tag}>=1\ntorch\nnumpy\n")
    monkeypatch.setattr(rq, "node_software", lambda cluster: here_software())
    req = TrainRequest.of(workdir=str(tmp_path / "proj"), script="train.py", env={STORE_ENV: store.as_uri()})
    said = []
    got = rq.prepare(req, SimpleNamespace(is_local=True), said.append)
    key = got.spec.what.pylayer
    folder = store / pylayer.prefix(key)
    assert sorted(p.name for p in folder.iterdir()) == sorted([
        f"xchello{tag}-1.2-py3-none-any.whl", f"xchellodep{tag}-0.3-py3-none-any.whl", pylayer.MANIFEST,
        pylayer.REQUIREMENTS])  # torch and numpy: the nodes have them; never-installed: not for this Python
    assert said == [(f"requirements requirements.txt: 2 wheel(s) for the nodes ({here_software().describe()}) put in "
                    f"the store as wheels {key}, {sum(p.stat().st_size for p in folder.glob('*.whl')) / 1024:.0f} KiB: "
                    f"xchello{tag} 1.2, xchellodep{tag} 0.3")]
    stamp = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    said.clear()
    assert rq.prepare(req, SimpleNamespace(is_local=True), said.append).spec.what.pylayer == key
    assert said == [f"requirements requirements.txt: wheels {key} already in the store (2 package(s); nothing sent)"]
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamp

    layer = tmp_path / "layer"
    assert pylayer.install(store.as_uri(), key, layer, tmp_path / "cache") == 2
    shown = subprocess.run([sys.executable, "-c", (f"import xchello{tag} as m, xchellodep{tag} as d; "
                            "print(m.__version__, d.__version__, m.__file__)")], env={**os.environ, "PYTHONPATH": str(layer)},
                           capture_output=True, text=True, check=True).stdout.split()
    assert shown[:2] == ["1.2", "0.3"] and shown[2].startswith(str(layer))


def test_from_an_s3_store_each_node_downloads_the_wheels_once(tmp_path, links, monkeypatch, aws_env):
    """As on AWS: the store is a bucket; a node keeps the wheels in its cache, so a second run reads no object."""
    from moto_fixture import client

    monkeypatch.setenv("XC_S3_ENDPOINT_URL", aws_env)
    client("s3").create_bucket(Bucket="xc-wheels")
    url = "s3://xc-wheels/cl1"
    write(tmp_path / "proj" / "requirements.txt", f"xchello{links.tag}\n")
    monkeypatch.setattr(rq, "node_software", lambda cluster: here_software())
    req = TrainRequest.of(workdir=str(tmp_path / "proj"), script="train.py", env={STORE_ENV: url})
    key = rq.prepare(req, SimpleNamespace(is_local=False), lambda line: None).spec.what.pylayer
    assert pylayer.install(url, key, tmp_path / "run1" / "pylayer", tmp_path / "cache") == 2
    assert (tmp_path / "cache" / key / pylayer.MANIFEST).is_file()
    open_store(url).delete_prefix(pylayer.prefix(key))  # gone from the store: the node's cache serves
    assert pylayer.install(url, key, tmp_path / "run2" / "pylayer", tmp_path / "cache") == 2
    assert sorted(p.name for p in (tmp_path / "run2" / "pylayer").iterdir() if not p.name.endswith(".dist-info")) == \
        sorted([f"xchello{links.tag}", f"xchellodep{links.tag}"])
    with pytest.raises(Exception, match=rf"the requirements' wheels wheels/{key} are not in the store {url}; "):
        pylayer.install(url, key, tmp_path / "run3" / "pylayer", tmp_path / "other-cache")


def test_a_dependency_on_another_torch_and_a_source_only_package_are_refused(tmp_path, links):
    tag, sw = links.tag, here_software()
    torch = sw.has("torch")[0]
    with pytest.raises(ClusterError) as exc:
        rq.resolve(rq.parse(write(tmp_path / "a.txt", f"xcold{tag}\n")), sw, tmp_path / "dl", "a.txt")
    assert str(exc.value) == (f"a.txt: xcold{tag} needs torch<2, but the local cluster's nodes (this machine's venv) "
                              f"have torch {torch}; drop xcold{tag} or pick a release of it that works with torch {torch}")
    with pytest.raises(ClusterError) as exc:
        rq.resolve(rq.parse(write(tmp_path / "b.txt", f"xcsource{tag}==1.0\n")), sw, tmp_path / "dl", "b.txt")
    assert str(exc.value) == (f"b.txt: xcsource{tag}==1.0 has no wheel for the nodes ({sw.describe()}), only a source "
                              "archive; the nodes install wheels only: pick a version that publishes one, or drop it")
    with pytest.raises(ClusterError, match=rf"^c.txt: xcnothing{tag}==1.0 is not in pip's index; "):
        rq.resolve(rq.parse(write(tmp_path / "c.txt", f"xcnothing{tag}==1.0\n")), sw, tmp_path / "dl", "c.txt")


def test_the_key_follows_the_requirements_and_the_nodes_platform(tmp_path):
    sw = here_software()
    a = rq.parse(write(tmp_path / "a.txt", "tabulate==0.9.0\n"))
    assert rq.key_of(a, sw) == rq.key_of(rq.parse(write(tmp_path / "b.txt", "# same\ntabulate == 0.9.0\n")), sw)
    assert rq.key_of(a, sw) != rq.key_of(rq.parse(write(tmp_path / "c.txt", "tabulate==0.8.10\n")), sw)
    other = rq.NodeSoftware({**sw.env, "python_full_version": "3.12.3", "python_version": "3.12"}, "2.39",
                            "cpython-312", sw.installed)
    assert rq.key_of(a, sw) != rq.key_of(a, other)
    assert other.platforms()[:2] == [f"manylinux_2_39_{sw.env['platform_machine']}",
                                     f"manylinux_2_38_{sw.env['platform_machine']}"]
    assert f"manylinux2014_{sw.env['platform_machine']}" in other.platforms()


# ---- the flag, the record and the ranks' path ------------------------------------------------------------------

def test_the_flag_is_absolute_refused_with_resume_and_kept_in_the_record(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flags = train_flags.TrainFlags(script="train.py", workdir=".", requirements="deps.txt")
    req = train_flags.resolve(flags, tmp_path / "runs").req
    assert req.spec.what.requirements == str(tmp_path / "deps.txt")
    with pytest.raises(ClusterError, match=r"drop --job/--script/--workdir/--module/--launcher/--requirements"):
        train_flags.resolve(train_flags.TrainFlags(resume="r1", requirements="deps.txt"), tmp_path / "runs")
    kept = TrainRequest.from_record(req.but(pylayer="abc123").to_record(), {}, set())
    assert (kept.spec.what.requirements, kept.spec.what.pylayer) == (str(tmp_path / "deps.txt"), "abc123")


def test_the_layer_comes_after_the_code_and_before_the_venv(tmp_path):
    env_sh = render("node_env.sh.j2", run_id="r", node="node0", python=sys.executable, code_dir="/c", rank_cpus=[],
                    env=[], workdir="/h/runs/r/work", pylayer="/h/runs/r/pylayer")
    script = f"{env_sh}\necho \"$PYTHONPATH\"\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={"PATH": os.environ["PATH"]},
                         check=True).stdout.strip()
    assert out == "/c/training/hook:/h/runs/r/work:/c:/h/runs/r/pylayer"
    assert "pylayer" not in render("node_env.sh.j2", run_id="r", node="node0", python="p", code_dir="/c",
                                   rank_cpus=[], env=[], workdir=None)


# ---- on the local cluster --------------------------------------------------------------------------------------

SCRIPT = """import os
import {module}
print(f"rank {{os.environ.get('RANK', '0')}} imported {module} {{{module}.__version__}} from "
      f"{{os.path.basename(os.path.dirname(os.path.dirname({module}.__file__)))}}")
"""


@pytest.mark.cluster
def test_a_workdirs_requirements_import_on_every_rank_and_another_torch_starts_nothing(cluster2, tmp_path):
    folder = tmp_path / "links"
    tag = uuid.uuid4().hex[:6]
    wheel(folder, f"xcrank{tag}", "2.0", (f"xcrankdep{tag}",))
    wheel(folder, f"xcrankdep{tag}", "0.1")
    proj = tmp_path / "proj"
    write(proj / "requirements.txt", f"xcrank{tag}==2.0\ntorch\n")
    write(proj / "train.py", SCRIPT.format(module=f"xcrank{tag}"))
    before = cluster2.run_dirs()
    res = cluster2.fab("train", "--nodes", "2", "--workdir", str(proj), "--script", "train.py", env=pip_env(folder),
                       timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "requirements requirements.txt: 2 wheel(s) for the nodes" in res.stdout
    for rank, node in ((0, "node0"), (1, "node1")):
        assert f"[{rank} {node}] rank {rank} imported xcrank{tag} 2.0 from pylayer" in res.stdout, res.stdout[-3000:]
    (run_id,) = cluster2.run_dirs() - before
    summary = records.load(cluster2.runs / run_id).to_json()
    assert summary["status"] == "ok" and summary["spec"]["what"]["pylayer"]

    write(proj / "requirements.txt", f"xcrank{tag}==2.0\ntorch==2.5.0\n")
    before = cluster2.run_dirs()
    res = cluster2.fab("train", "--nodes", "2", "--workdir", str(proj), "--script", "train.py", env=pip_env(folder),
                       timeout=120)
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode != 0 and errors[-1].startswith("error: requirements.txt pins torch==2.5.0, but the local "
                                                         "cluster's nodes (this machine's venv) have torch "), res.stderr
    assert len([e for e in errors if e.startswith("error:")]) == 1
    assert cluster2.run_dirs() == before  # no run folder, so no run: nothing started
