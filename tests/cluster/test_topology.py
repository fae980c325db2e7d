"""Topology parsing and layout derivation on recorded probe output (lscpu written from AWS's specs)."""
from pathlib import Path

import pytest

from launch.plan import topology

DATA = Path(__file__).parents[1] / "data"


def load(name: str) -> topology.Topology:
    return topology.parse((DATA / f"{name}.probe").read_text())


def test_c6i_16xlarge_is_one_icelake_socket_without_bf16():
    t = load("c6i.16xlarge")
    assert t.sockets == 1 and t.threads_per_core == 2
    assert t.physical_cores == 32
    assert t.cores_by_socket[0] == tuple(range(32))  # first hyperthread of each core
    assert not t.amx and not t.bf16
    assert "avx512_vnni" in t.flags
    assert t.malloc.endswith("libjemalloc.so.2")  # no tcmalloc on that node: jemalloc is next
    assert t.kernel == "5.15.0-1051-aws"
    assert 120 < t.mem_gib < 126


def test_r7iz_metal_16xl_has_amx_and_prefers_tcmalloc():
    t = load("r7iz.metal-16xl")
    assert t.physical_cores == 32
    assert t.amx and t.bf16
    assert t.malloc.endswith("libtcmalloc.so.4")
    assert "AMX" in t.summary()


@pytest.mark.parametrize("name", ["c6i.16xlarge", "r7iz.metal-16xl", "r7iz.metal-32xl"])
def test_recorded_topology_matches_the_instance_catalog(name):
    catalog = pytest.importorskip("core.catalog")
    spec = catalog.CATALOG[name]
    t = load(name)
    assert t.physical_cores == spec.cores
    assert len(t.cores_by_socket) == spec.sockets
    assert t.amx == spec.amx


def test_default_layout_is_one_rank_per_socket_with_all_its_cores():
    t = load("r7iz.metal-32xl")
    layout = topology.derive_layout(t, backend="gloo")
    assert layout.ppn == 2
    assert layout.omp_threads == 32 and layout.ccl_workers == 0
    assert layout.rank_cpus[0] == tuple(range(32)) and layout.rank_cpus[1] == tuple(range(32, 64))


def test_ccl_layout_reserves_worker_cores_inside_each_rank():
    t = load("r7iz.metal-16xl")
    layout = topology.derive_layout(t, ppn=2, backend="ccl")
    assert layout.ppn == 2
    assert layout.ccl_workers == 2  # 16 cores per rank -> 2 workers, 14 compute threads
    assert layout.omp_threads == 14
    assert layout.ccl_cpus == (14, 15, 30, 31)
    assert set(layout.ccl_cpus) <= set(layout.rank_cpus[0]) | set(layout.rank_cpus[1])


def test_ppn_not_multiple_of_sockets_splits_cores_evenly():
    t = load("r7iz.metal-32xl")
    layout = topology.derive_layout(t, ppn=3)
    sizes = [len(c) for c in layout.rank_cpus]
    assert sum(sizes) == 64 and max(sizes) - min(sizes) <= 1


def test_explicit_threads_beyond_cores_is_flagged():
    t = load("c6i.16xlarge")
    layout = topology.derive_layout(t, ppn=4, threads=12)
    assert layout.omp_threads == 12
    assert any("oversubscribed" in n for n in layout.notes)


def test_restricted_affinity_counts_only_allowed_cores():
    text = (DATA / "c6i.16xlarge.probe").read_text().replace("Cpus_allowed_list:\t0-63", "Cpus_allowed_list:\t4-7,36-39")
    t = topology.parse(text)
    assert t.physical_cores == 4
    assert t.cores_by_socket == ((4, 5, 6, 7),)


def test_pin_domain_masks():
    t = load("r7iz.metal-32xl")
    layout = topology.derive_layout(t)
    assert layout.pin_domain() == f"[{hex((1 << 32) - 1)},{hex(((1 << 32) - 1) << 32)}]"


def test_missing_lscpu_is_a_clear_error():
    with pytest.raises(ValueError, match="lscpu"):
        topology.parse("### uname\n6.8.0\n")


def test_cpu_list_parsing():
    assert topology.parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]


def test_nodes_of_different_sizes_get_one_thread_and_ccl_worker_count():
    # a 16-core-per-rank node would take 2 CCL workers, an 8-core one 1; CCL_WORKER_COUNT is global
    big, small = load("r7iz.metal-32xl"), load("c6i.16xlarge")
    alone = [topology.derive_layout(t, ppn=4, backend="ccl") for t in (big, small)]
    assert alone[0].ccl_workers != alone[1].ccl_workers or alone[0].omp_threads != alone[1].omp_threads
    layouts = topology.derive_layouts([big, small], ppn=4, threads=None, backend="ccl")
    assert {lay.ccl_workers for lay in layouts} == {min(a.ccl_workers for a in alone)}
    assert {lay.omp_threads for lay in layouts} == {min(a.omp_threads for a in alone)}
    for lay in layouts:  # each node's CCL_WORKER_AFFINITY lists exactly workers x ranks CPUs
        assert len(lay.ccl_cpus) == lay.ccl_workers * lay.ppn
    # an explicit --threads stands; the worker count still agrees
    fixed = topology.derive_layouts([big, small], ppn=4, threads=4, backend="ccl")
    assert {lay.omp_threads for lay in fixed} == {4} and len({lay.ccl_workers for lay in fixed}) == 1


def test_the_probe_lists_every_allocator_path_and_this_machine_picks_as_a_node_would(monkeypatch):
    """local_malloc() (the benches' choice) and the probe's parse pick with one rule from one list of paths."""
    assert all(p in topology.PROBE for p in topology.MALLOC_PATHS)
    present = {"/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}
    monkeypatch.setattr("os.path.isfile", lambda p: p in present)
    assert topology.local_malloc() == "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # tcmalloc before jemalloc
    probed = topology.split_sections("### malloc\n" + "\n".join(sorted(present)))["malloc"].split()
    assert topology.preferred_malloc(probed) == topology.local_malloc()
    present.clear()
    assert topology.local_malloc() is None
