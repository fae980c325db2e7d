"""The profile matrix, the rendered setup script and its marker logic (no network, no SSH)."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

from core.errors import ClusterError
from node_setup import profiles as P

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INTEL_INDEX = "https://pytorch-extension.intel.com/release-whl/stable/cpu/us/"


@pytest.fixture(scope="module")
def profiles():
    return P.load_profiles()


def pkg(profile, name):
    return next(p for p in profile.packages if P.normalize(p.name) == P.normalize(name))


def test_shipped_profiles_exist(profiles):
    assert {"oneccl", "upstream", "test"} <= set(profiles)
    for p in profiles.values():
        assert p.description and p.backend in P.BACKENDS and p.precision in P.PRECISIONS


def test_oneccl_is_the_last_matched_set_with_cpu_oneccl_bindings(profiles):
    p = profiles["oneccl"]
    assert p.backend == "ccl" and p.precision == "ipex-bf16"
    torch = pkg(p, "torch")
    assert re.fullmatch(r"2\.7\.\d+\+cpu", torch.version) and torch.source == TORCH_CPU_INDEX
    assert pkg(p, "intel-extension-for-pytorch").version == "2.7.0"
    ccl = pkg(p, "oneccl_bind_pt")
    assert (ccl.version, ccl.source) == ("2.7.0+cpu", INTEL_INDEX)
    assert P.major_minor(pkg(p, "intel_extension_for_pytorch").version) == P.major_minor(torch.version)
    # transformers 4.57 dropped --use_ipex and accelerate 1.13 turns ccl into gloo on CPU.
    assert tuple(map(int, p.version_of("transformers").split(".")[:2])) < (4, 57)
    assert tuple(map(int, p.version_of("accelerate").split(".")[:2])) < (1, 13)
    assert p.version_of("impi-rt")
    assert {"python3-venv", "libjemalloc2", "numactl", "google-perftools"} <= set(p.system_packages)
    eol = " ".join(p.eol_notes)
    assert "intel_extension_for_pytorch" in eol and "oneccl_bind_pt" in eol
    assert set(p.extra_index_urls) == {TORCH_CPU_INDEX, INTEL_INDEX}


def test_upstream_is_gloo_autocast_without_intel_extensions(profiles):
    p = profiles["upstream"]
    assert (p.backend, p.precision) == ("gloo", "autocast-bf16")
    assert p.version_of("torch").endswith("+cpu") and pkg(p, "torch").source == TORCH_CPU_INDEX
    assert p.version_of("transformers").startswith("5.")
    assert p.version_of("intel_extension_for_pytorch") is None and p.version_of("oneccl_bind_pt") is None
    assert not p.eol_notes
    assert p.extra_index_urls == (TORCH_CPU_INDEX,)


def test_test_profile_is_tiny(profiles):
    p = profiles["test"]
    assert p.system_packages == () and p.extra_index_urls == ()
    assert P.pip_requirements(p) == ["six==1.16.0"]
    assert p.venv.startswith("~/")


def test_pip_requirements_are_exact_pins(profiles):
    reqs = P.pip_requirements("oneccl")
    assert "torch==2.7.1+cpu" in reqs and "oneccl_bind_pt==2.7.0+cpu" in reqs
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.+]*", r) for r in reqs)


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(ClusterError) as exc:
        P.load_profile("onecl")
    msg = str(exc.value)
    assert "'onecl'" in msg and "oneccl" in msg and "upstream" in msg and "--profile" in msg


def write_profiles(tmp_path, body):
    path = tmp_path / "profiles.toml"
    path.write_text(textwrap.dedent(body))
    return path


BASE = """
    [profiles.x]
    description = "x"
    backend = "{backend}"
    precision = "fp32"
    python_min = "3.10"
    system_packages = []
    extra_index_urls = {urls}
    [profiles.x.packages]
    torch = {{ version = "2.7.1+cpu", source = "{src}" }}
    {extra}
"""


def test_loader_accepts_a_valid_file_and_defaults_the_venv(tmp_path):
    path = write_profiles(tmp_path, BASE.format(backend="gloo", urls=f'["{TORCH_CPU_INDEX}"]', src=TORCH_CPU_INDEX,
                                                extra=""))
    assert P.load_profile("x", path).venv == P.DEFAULT_VENV


@pytest.mark.parametrize("backend,urls,src,extra,needle", [
    # IPEX built for torch 2.8 beside torch 2.7: the classic mismatch.
    ("gloo", f'["{TORCH_CPU_INDEX}"]', TORCH_CPU_INDEX,
     'intel_extension_for_pytorch = { version = "2.8.0" }', "built for torch 2.8.*"),
    ("gloo", "[]", TORCH_CPU_INDEX, "", "not in extra_index_urls"),
    ("gloo", f'["{TORCH_CPU_INDEX}", "https://example.invalid/simple"]', TORCH_CPU_INDEX, "", "serve no package"),
    ("ccl", f'["{TORCH_CPU_INDEX}"]', TORCH_CPU_INDEX, "", "without oneccl_bind_pt"),
    ("nccl", f'["{TORCH_CPU_INDEX}"]', TORCH_CPU_INDEX, "", "backend 'nccl'"),
    ("gloo", f'["{TORCH_CPU_INDEX}"]', TORCH_CPU_INDEX, 'six = { version = ">=1.16" }', "not an exact pin"),
    ("gloo", f'["{TORCH_CPU_INDEX}"]', TORCH_CPU_INDEX, 'six = { verison = "1.16.0" }', "package six"),
])
def test_loader_rejects_broken_profiles(tmp_path, backend, urls, src, extra, needle):
    path = write_profiles(tmp_path, BASE.format(backend=backend, urls=urls, src=src, extra=extra))
    with pytest.raises(ClusterError, match=re.escape(needle)) as exc:
        P.load_profiles(path)
    assert "profile 'x'" in str(exc.value) and "\n" not in str(exc.value)


def test_loader_rejects_a_misspelled_key(tmp_path):
    body = BASE.format(backend="gloo", urls=f'["{TORCH_CPU_INDEX}"]', src=TORCH_CPU_INDEX, extra="")
    path = write_profiles(tmp_path, body.replace("system_packages", "sytem_packages"))
    with pytest.raises(ClusterError, match="sytem_packages"):
        P.load_profiles(path)


def test_hash_is_stable_and_tracks_what_is_installed(profiles):
    p = profiles["oneccl"]
    assert re.fullmatch(r"[0-9a-f]{16}", p.hash)
    assert p.hash == P.load_profiles()["oneccl"].hash
    assert len({q.hash for q in profiles.values()}) == len(profiles)
    bumped = tuple(dataclasses.replace(x, version="4.56.1") if x.name == "transformers" else x for x in p.packages)
    assert dataclasses.replace(p, packages=bumped).hash != p.hash
    assert dataclasses.replace(p, system_packages=p.system_packages + ("htop",)).hash != p.hash
    # Rewording is not reinstalling.
    assert dataclasses.replace(p, description="reworded").hash == p.hash
    assert dataclasses.replace(p, packages=tuple(reversed(p.packages))).hash == p.hash


@pytest.mark.parametrize("name", ["oneccl", "upstream", "test"])
def test_every_profile_renders_a_valid_script(name, profiles, tmp_path):
    script = P.render_setup_script(name)
    assert "{{" not in script and "{%" not in script and "}}" not in script
    assert "set -euo pipefail" in script and profiles[name].hash in script
    for req in P.pip_requirements(name):
        assert req in script
    path = tmp_path / "setup.sh"
    path.write_text(script)
    res = subprocess.run(["bash", "-n", str(path)], check=False, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_script_indexes_and_apt_follow_the_profile():
    oneccl = P.render_setup_script("oneccl")
    assert f"--extra-index-url {TORCH_CPU_INDEX} " in oneccl and f"--extra-index-url {INTEL_INDEX} " in oneccl
    assert "DEBIAN_FRONTEND=noninteractive apt-get" in oneccl and "sudo -n" in oneccl
    assert "warning: end-of-life" in oneccl
    upstream = P.render_setup_script("upstream")
    assert INTEL_INDEX not in upstream and "(3, 11)" in upstream
    test = P.render_setup_script("test")
    assert "apt-get" not in test and "--extra-index-url" not in test
    assert 'VENV="$HOME"/.xeon-cluster/venv-test' in test


def test_script_is_identical_for_the_same_inputs():
    # `fab setup` and the Image Builder component both call this: same profile, same text.
    assert P.render_setup_script("oneccl") == P.render_setup_script(P.load_profile("oneccl"))


def test_venv_override_and_unsafe_paths(tmp_path):
    venv = tmp_path / "my venv"
    assert f"VENV='{venv}'" in P.render_setup_script("test", venv=str(venv))
    for bad in ["/", "/opt", "relative/venv", "/opt/../etc/x", "~/"]:
        with pytest.raises(ClusterError, match="venv path"):
            P.render_setup_script("test", venv=bad)


def run_script(script, tmp_path, **env):
    path = tmp_path / "setup.sh"
    path.write_text(script)
    full_env = {**os.environ, "HOME": str(tmp_path / "home"), **env}
    return subprocess.run(["bash", str(path)], check=False, capture_output=True, text=True, env=full_env,
                          timeout=120)


def test_second_run_is_a_no_op(profiles, tmp_path):
    # No packages: the whole script runs for real (venv, marker) without touching the network.
    empty = dataclasses.replace(profiles["test"], packages=())
    script = P.render_setup_script(empty)
    venv = tmp_path / "home" / ".xeon-cluster" / "venv-test"  # the profile's ~/ path, expanded on the node

    first = run_script(script, tmp_path)
    assert first.returncode == 0, first.stderr
    assert "==> [test] creating venv" in first.stdout and "already set up" not in first.stdout
    assert (venv / ".xeon-cluster-profile").read_text().strip() == empty.hash
    assert (venv / "bin" / "python").exists()
    sentinel = venv / "left-by-first-run"
    sentinel.write_text("x")

    second = run_script(script, tmp_path)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == f"already set up (profile test, hash {empty.hash})"
    assert sentinel.exists()  # venv --clear would have removed it

    # A changed profile is a new hash: the venv is rebuilt from scratch and re-marked.
    changed = dataclasses.replace(empty, python_min="3.8")
    third = run_script(P.render_setup_script(changed), tmp_path)
    assert third.returncode == 0, third.stderr
    assert "creating venv" in third.stdout and not sentinel.exists()
    assert (venv / ".xeon-cluster-profile").read_text().strip() == changed.hash


def test_failed_run_leaves_no_marker_and_is_retried(profiles, tmp_path):
    venv = tmp_path / "venv"
    # A venv left by another profile: its marker must not count.
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    (venv / ".xeon-cluster-profile").write_text("0123456789abcdef\n")
    impossible = dataclasses.replace(profiles["test"], packages=(), python_min="99.0")
    script = P.render_setup_script(impossible, venv=str(venv))
    for _ in range(2):
        res = run_script(script, tmp_path)
        assert res.returncode != 0 and "older than 99.0" in res.stderr
        assert "already set up" not in res.stdout
        assert (venv / ".xeon-cluster-profile").read_text() == "0123456789abcdef\n"


def test_failed_pip_install_leaves_no_marker(profiles, tmp_path):
    venv = tmp_path / "venv"
    # pip with no index at all: installing six fails at once, offline, after the venv is made.
    offline = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path), "PIP_CONFIG_FILE": os.devnull}
    res = run_script(P.render_setup_script("test", venv=str(venv)), tmp_path, **offline)
    assert res.returncode != 0 and "No matching distribution found for six==1.16.0" in res.stderr
    assert "==> [test] pip install six==1.16.0" in res.stdout and "writing marker" not in res.stdout
    assert (venv / "bin" / "python").exists() and not (venv / ".xeon-cluster-profile").exists()


def test_script_refuses_to_clear_a_directory_that_is_not_a_venv(tmp_path):
    target = tmp_path / "data" / "precious"
    target.mkdir(parents=True)
    (target / "keep.txt").write_text("x")
    empty = dataclasses.replace(P.load_profile("test"), packages=())
    res = run_script(P.render_setup_script(empty, venv=str(target)), tmp_path)
    assert res.returncode != 0 and "is not a venv" in res.stderr
    assert (target / "keep.txt").exists()


def test_matched_set_problems():
    p = P.load_profile("oneccl")
    installed = {pkg.name: pkg.version for pkg in p.packages}
    assert P.matched_set_problems(p, installed) == []
    # importlib.metadata spells names its own way and IPEX may report a +cpu label: both fine.
    relaxed = {P.normalize(k): v for k, v in installed.items()} | {"intel-extension-for-pytorch": "2.7.0+cpu"}
    assert P.matched_set_problems("oneccl", relaxed) == []

    broken = dict(installed, torch="2.8.0+cpu")
    del broken["datasets"]
    problems = P.matched_set_problems(p, broken)
    assert any(s.startswith("torch 2.8.0+cpu is installed but profile oneccl pins 2.7.1+cpu") for s in problems)
    assert any(s.startswith("datasets is not installed") for s in problems)
    # torch moved under IPEX and the bindings: both named as built for 2.7.
    assert sum("needs torch 2.7.* but torch 2.8.0+cpu" in s for s in problems) == 2
    assert all("fab setup --profile oneccl" in s for s in problems)


def test_fab_setup_runs_the_image_builder_text_on_real_nodes(profiles):
    from cluster.node import Node
    from node_setup.setup import default_venv

    real = [Node("n0", "203.0.113.10", "10.0.0.10", "ubuntu"), Node("n1", "203.0.113.11", "10.0.0.11", "ubuntu")]
    local = [Node("node0", "127.0.0.2", "127.0.0.2", "me", home="/s/nodes/node0/home", labels={"local": True})]
    for name, p in profiles.items():
        # infra/image.py bakes render_setup_script(name): fab setup on real nodes runs the same text.
        assert P.render_setup_script(p, venv=default_venv(p, real)) == P.render_setup_script(name)
    # Local nodes share one filesystem: only a per-user venv moves, under each node's own work root.
    assert default_venv(profiles["test"], local) == "$XC_HOME/venv-test"
    assert default_venv(profiles["oneccl"], local) == "/opt/xeon-cluster/venv"


def test_work_root_venv_expands_on_the_node_and_needs_xc_home(profiles, tmp_path):
    empty = dataclasses.replace(profiles["test"], packages=())
    script = P.render_setup_script(empty, venv="$XC_HOME/venv-test")
    node_home = tmp_path / "node3-home"
    res = run_script(script, tmp_path, XC_HOME=str(node_home))
    assert res.returncode == 0, res.stderr
    assert (node_home / "venv-test" / P.MARKER_NAME).read_text().strip() == empty.hash
    env = {k: v for k, v in os.environ.items() if k != "XC_HOME"}
    path = tmp_path / "setup.sh"
    unset = subprocess.run(["bash", str(path)], check=False, capture_output=True, text=True,
                           env={**env, "HOME": str(tmp_path / "home")}, timeout=60)
    assert unset.returncode != 0 and "XC_HOME: is not set" in unset.stderr
    with pytest.raises(ClusterError, match="venv path"):
        P.render_setup_script("test", venv="$XC_HOME/../elsewhere")


# ---- upstream-ccl: torch-ccl built on the node (rendered and checked here; the build needs GitHub) ----

TORCH_CCL = "https://github.com/intel/torch-ccl"


def test_upstream_ccl_builds_torch_ccl_at_a_pinned_commit_against_current_torch(profiles):
    p = profiles["upstream-ccl"]
    assert p.backend == "ccl" and p.version_of("torch") == profiles["upstream"].version_of("torch")
    ccl = pkg(p, "oneccl_bind_pt")
    assert (ccl.source, ccl.git, ccl.module) == ("git", TORCH_CCL, "oneccl_bindings_for_pytorch")
    assert re.fullmatch(r"[0-9a-f]{40}", ccl.commit)
    assert p.version_of("oneccl-cpu") == p.version_of("oneccl-cpu-devel") == "2021.16.2"
    assert p.version_of("impi-devel") == p.version_of("impi-rt")  # headers of the MPI the ranks run
    reqs = P.pip_requirements(p)
    assert not any(r.startswith("oneccl_bind_pt") for r in reqs)  # not from an index
    script = P.render_setup_script(p)
    build = script.index(f"git -C \"$SRC\" checkout --quiet --detach {ccl.commit}")
    assert script.index("pip install") < build < script.index("writing marker")  # after torch, before the marker
    assert 'USE_SYSTEM_ONECCL="1"' in script and 'CCL_ROOT="$VENV"' in script
    assert "import torch, oneccl_bindings_for_pytorch" in script
    subprocess.run(["bash", "-n", "-c", script], check=True)


def test_a_package_built_on_the_node_is_not_held_to_its_wheels_torch_label():
    p = P.load_profile("upstream-ccl")
    installed = {"torch": "2.13.0+cpu", "oneccl_bind_pt": "2.8.0+xpu"}
    assert P.torch_bound_mismatches(installed) != []  # an index wheel 2.8 beside torch 2.13 is wrong...
    assert P.torch_bound_mismatches(installed, p.built_here) == []  # ...one compiled against it is not
    full = {pk.name: pk.version for pk in p.packages}
    assert P.matched_set_problems(p, full) == []


def test_the_build_changes_the_hash_and_other_profiles_keep_theirs(profiles):
    p = profiles["upstream-ccl"]
    ccl = pkg(p, "oneccl_bind_pt")
    other = dataclasses.replace(ccl, commit="0" * 40)
    changed = dataclasses.replace(p, packages=tuple(other if x is ccl else x for x in p.packages))
    assert changed.hash != p.hash
    # hashes nodes already carry: adding source builds must not make them reinstall (boto3, for the cluster's
    # store, gcc, for the jobs' own kernels, and the supervisor's packages, for the head that boots the nodes' image,
    # and tensorboard, for the jobs' event files, changed upstream's on purpose: nodes need them installed)
    assert profiles["oneccl"].hash == "5f57b70987e47e40" and profiles["upstream"].hash == "7606fdf0bc6f944d"


@pytest.mark.parametrize("extra, needle", [
    ('oneccl_bind_pt = { version = "2.8.0+xpu", source = "git", git = "http://x/y", commit = "'
     + "a" * 40 + '", module = "m" }\naccelerate = { version = "1.15.0" }', "https git URL"),
    (('oneccl_bind_pt = { version = "2.8.0+xpu", source = "git", git = "https://x/y", commit = "abc", module = "m" }'
     '\naccelerate = { version = "1.15.0" }'), "40-hex commit"),
    ('oneccl_bind_pt = { version = "2.8.0+xpu", source = "git", git = "https://x/y", commit = "' + "a" * 40
     + '", module = "m", build_env = { X = "a b" } }\naccelerate = { version = "1.15.0" }', "cannot quote"),
    ('oneccl_bind_pt = { version = "2.7.0+cpu", source = "git", git = "https://x/y", commit = "' + "a" * 40
     + '", module = "m" }\naccelerate = { version = "1.9.0" }', "accelerate 1.9.0"),
])
def test_source_builds_and_ccl_accelerate_are_checked(tmp_path, extra, needle):
    path = write_profiles(tmp_path, BASE.format(backend="ccl", urls=f'["{TORCH_CPU_INDEX}"]', src=TORCH_CPU_INDEX,
                                                extra=extra))
    with pytest.raises(ClusterError, match=re.escape(needle)):
        P.load_profiles(path)


def test_setup_keeps_the_profile_the_nodes_carry_and_never_switches_a_venv_silently():
    from core.errors import ClusterError
    from node_setup.setup import choose_profile

    venv = {"oneccl": "/opt/xeon-cluster/venv", "upstream": "/opt/xeon-cluster/venv", "test": "~/t"}.get
    baked = {"node0": "oneccl", "node1": "oneccl"}
    # a plain `fab setup` on a baked cluster keeps oneccl, not the fallback
    assert choose_profile(None, baked, venv, "upstream") == ("oneccl", "carried by the nodes")
    assert choose_profile(None, {"node0": None}, venv, "upstream")[0] == "upstream"
    with pytest.raises(ClusterError, match=r"^node0 carries profile oneccl in /opt/xeon-cluster/venv, which "
                                           r"--profile upstream would replace; pass --force"):
        choose_profile("upstream", baked, venv, "upstream")
    assert choose_profile("upstream", baked, venv, "upstream", force=True)[0] == "upstream"
    assert choose_profile("test", baked, venv, "upstream") == ("test", "--profile")  # another venv: no clash
    with pytest.raises(ClusterError, match=r"different profiles \(node0: oneccl, node1: upstream\)"):
        choose_profile(None, {"node0": "oneccl", "node1": "upstream"}, venv, "upstream")


@pytest.mark.parametrize("name", ["upstream", "upstream-ccl"])
def test_the_baked_venv_holds_what_the_heads_supervisor_imports(name):
    """An AWS head boots the nodes' baked image and runs supervisors with its venv: every package a supervisor imports
    is in the profile (without them every detached run on AWS would end in ModuleNotFoundError)."""
    from launch.life.head import SUPERVISOR_IMPORTS

    modules = {m.strip() for m in SUPERVISOR_IMPORTS.removeprefix("import ").split(",")}
    dist = {"yaml": "pyyaml", "packaging": "transformers"}  # packaging: a requirement of transformers' own
    have = {P.normalize(p.name) for p in P.load_profile(name).packages}
    assert {P.normalize(dist.get(m, m)) for m in modules} <= have
    from importlib.metadata import requires

    assert any(r.split(">")[0].split("=")[0].strip() == "packaging" for r in requires("transformers"))


def test_supervisor_imports_names_what_a_supervisor_loads():
    code = ("import sys; b = set(sys.modules); import launch.supervision.supervisor, launch.life.head, node_setup.head_boot; "
            "print(' '.join(sorted({m.split('.')[0] for m in set(sys.modules) - b})))")
    loaded = set(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split())
    from launch.life.head import SUPERVISOR_IMPORTS

    named = {m.strip() for m in SUPERVISOR_IMPORTS.removeprefix("import ").split(",")}
    theirs = {"bcrypt", "cryptography", "nacl", "markupsafe", "decorator", "cython_runtime"}  # named ones' own
    ours = {"launch", "cluster", "core", "training", "node_setup", "doctor", "reports", "infra", "twin", "sweep"}
    third = {m for m in loaded if m not in sys.stdlib_module_names and not m.startswith("_")} - ours - theirs
    assert third <= named, f"a supervisor imports {sorted(third - named)}: add them to SUPERVISOR_IMPORTS and profiles"
