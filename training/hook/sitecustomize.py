# On PYTHONPATH for every rank: line-buffered output, so mpirun's per-line rank prefixes stay
# whole (unbuffered output splits print() into two writes) and nothing waits in a buffer.
import sys

for _stream in (sys.stdout, sys.stderr):
    try:
        _stream.reconfigure(line_buffering=True)
    except (AttributeError, ValueError):
        pass

import gc as _gc
import os as _os

# Start-up without the collector's passes over torch's and transformers' imports (training/runtime/startup.py, whose
# HIGH this is): put back when the rank's group forms or its Trainer trains.
GC_THRESHOLD = _gc.get_threshold()
_gc.set_threshold(100_000, 50, 100)

# Hooks run after a module is first imported, by a meta-path finder: a process that never imports it pays nothing.
_after_import = {}  # module name -> [function(module)]


def _on_import(name, function):
    _after_import.setdefault(name, []).append(function)


if _os.environ.get("XC_RANK_REPORT"):
    import importlib.abc as _abc
    import importlib.util as _util

    class _Watch(_abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            hooks = _after_import.pop(name, None)
            if not hooks:
                return None
            spec = _util.find_spec(name)  # the finders after this one (this name is no longer watched)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                for hook in hooks:
                    try:
                        hook(module)
                    except Exception as exc:  # noqa: BLE001 - a hook of ours never fails the rank's import
                        print(f"warning: xeon-cluster's rank hook on {name}: {exc}", file=sys.stderr, flush=True)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Watch())

# Whether the ranks formed one job: the largest torch.distributed group this rank joined goes to
# XC_RANK_REPORT at exit, so fab can tell a run whose ranks each trained alone from a real one (a script
# may destroy its group before exiting, so the size is caught when the group is made).
if _os.environ.get("XC_RANK_REPORT") and int(_os.environ.get("WORLD_SIZE", "1") or 1) > 1:
    import atexit as _atexit
    import json as _json

    _joined = {"world": 0}

    def _patch(module):
        original = module.init_process_group

        def init_process_group(*args, **kwargs):
            out = original(*args, **kwargs)
            _settle()
            try:
                _joined["world"] = max(_joined["world"], module.get_world_size())
            except Exception:  # noqa: BLE001, S110 - a report, never the rank's failure
                pass
            _group_made(module)
            return out

        module.init_process_group = init_process_group

    _on_import("torch.distributed.distributed_c10d", _patch)

    def _report():
        if "torch" not in sys.modules:  # no training in this process (a helper, a plain script): nothing to say
            return
        try:
            dist = sys.modules.get("torch.distributed")
            if dist is not None and dist.is_available() and dist.is_initialized():
                _joined["world"] = max(_joined["world"], dist.get_world_size())
            path = _os.environ["XC_RANK_REPORT"].replace("{rank}", _os.environ.get("RANK", "0"))
            _os.makedirs(_os.path.dirname(path) or ".", exist_ok=True)
            try:  # a launcher (accelerate launch) exits after the rank it started: keep the rank's group
                with open(path) as f:
                    _joined["world"] = max(_joined["world"], int(_json.load(f).get("joined") or 0))
            except (OSError, ValueError):
                pass
            with open(path, "w") as f:
                _json.dump({"rank": int(_os.environ.get("RANK", "0")), "world_size": int(_os.environ["WORLD_SIZE"]),
                            "joined": _joined["world"]}, f)
        except Exception:  # noqa: BLE001, S110 - a report, never the rank's failure
            pass

    _atexit.register(_report)


# Spot notices for users' own scripts (docs/scripts.md, "Spot notices in your own script"): XC_SPOT_HOOK=0 turns
# them off. Every transformers.Trainer gets training.runtime.preempt's behaviour; a script that makes a torch.distributed
# group gets training.runtime.contract's notice file; a resumed run's checkpoint is on the node before the script starts.
_spot = bool(_os.environ.get("XC_RANK_REPORT") and _os.environ.get("XC_RUN_ID")) and _os.environ.get("XC_SPOT_HOOK") != "0"


_OURS = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))  # our `training` package: hook/..
_ours_loaded = {}  # our training.* modules, kept out of sys.modules where the user's project has its own `training`


def _is_ours(found):  # a module, or a spec the path finder returned
    where = getattr(found, "__path__", None) or getattr(found, "submodule_search_locations", None) or ()
    return any(_os.path.realpath(p) == _os.path.realpath(_OURS) for p in where)


def _ours(name):
    """Our training.<name>, also where the user's project has a top-level `training` of its own (first on a --workdir
    run's sys.path): theirs is set aside while ours imports, then put back, so each side keeps its own."""
    import importlib
    import importlib.util

    loaded = sys.modules.get("training")
    if loaded is None and not _ours_loaded:
        loaded = importlib.util.find_spec("training")  # what a plain import would take: ours, or the user's
    if not _ours_loaded and (loaded is None or _is_ours(loaded)):
        return importlib.import_module("training." + name)
    scope = [k for k in sys.modules if k == "training" or k.startswith("training.")]
    theirs = {k: sys.modules.pop(k) for k in scope}
    try:
        sys.modules.update(_ours_loaded)
        if "training" not in sys.modules:
            spec = importlib.util.spec_from_file_location("training", _os.path.join(_OURS, "__init__.py"),
                                                          submodule_search_locations=[_OURS])
            package = importlib.util.module_from_spec(spec)
            sys.modules["training"] = package
            spec.loader.exec_module(package)
        return importlib.import_module("training." + name)
    finally:
        scope = [k for k in sys.modules if k == "training" or k.startswith("training.")]
        _ours_loaded.update({k: sys.modules.pop(k) for k in scope})
        sys.modules.update(theirs)


def _settle():
    try:
        _ours("runtime.startup").settle()
    except Exception as exc:  # noqa: BLE001 - start-up's speed, never the rank's failure
        print(f"warning: xeon-cluster's rank hook: {exc}", file=sys.stderr, flush=True)


def _cache_import_structure(module):
    _ours("runtime.startup").cache_import_structure(module)


_on_import("transformers.utils.import_utils", _cache_import_structure)


def _group_made(dist):
    if not _spot or getattr(_group_made, "agent", None) is not None:
        return
    try:
        _group_made.agent = _ours("runtime.contract").start(sys.modules.get("torch.distributed") or dist)
    except Exception as exc:  # noqa: BLE001 - a hook of ours never fails the script's init_process_group
        _group_made.agent = False
        print(f"warning: xeon-cluster's spot notice file is off: {exc}", file=sys.stderr, flush=True)


if _spot:  # training.runtime.contract's variables, set here with no import: scripts may read them first thing
    _run = _os.path.dirname(_os.path.dirname(_os.environ["XC_RANK_REPORT"]))
    _os.environ.setdefault("XC_NOTICE_FILE", _os.path.join(_run, "notice", f"rank-{_os.environ.get('RANK') or '0'}.json"))
    _os.environ.setdefault("XC_CHECKPOINT_DIR", _os.environ.get("XC_OUTPUT_DIR") or _os.path.join(_run, "output"))
    if _os.environ.get("XC_RESUME_URL"):
        try:
            _ours("runtime.store").fetch_resume()
        except Exception as _exc:  # noqa: BLE001 - a resume that cannot fetch its checkpoint must not start anew
            print(f"error: {_exc}", file=sys.stderr, flush=True)
            _os._exit(2)

    def _patch_trainer(module):
        _ours("runtime.preempt").patch(module.Trainer)

    _on_import("transformers.trainer", _patch_trainer)
    if int(_os.environ.get("WORLD_SIZE", "1") or 1) <= 1:  # one rank: the report's hook on the group is not there
        _on_import("torch.distributed.distributed_c10d", lambda m: _wrap_single(m))

    def _wrap_single(module):
        original = module.init_process_group

        def init_process_group(*args, **kwargs):
            out = original(*args, **kwargs)
            _settle()
            _group_made(module)
            return out

        module.init_process_group = init_process_group
