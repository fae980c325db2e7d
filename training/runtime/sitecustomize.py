# On PYTHONPATH for every rank: line-buffered output, so mpirun's per-line rank prefixes stay
# whole (unbuffered output splits print() into two writes) and nothing waits in a buffer.
import sys

for _stream in (sys.stdout, sys.stderr):
    try:
        _stream.reconfigure(line_buffering=True)
    except (AttributeError, ValueError):
        pass

# Whether the ranks formed one job: the largest torch.distributed group this rank joined goes to
# XC_RANK_REPORT at exit, so fab can tell a run whose ranks each trained alone from a real one (a script
# may destroy its group before exiting, so the size is caught when the group is made).
import os as _os

if _os.environ.get("XC_RANK_REPORT") and int(_os.environ.get("WORLD_SIZE", "1") or 1) > 1:
    import atexit as _atexit
    import importlib.abc as _abc
    import importlib.util as _util
    import json as _json

    _joined = {"world": 0}

    def _patch(module):
        original = module.init_process_group

        def init_process_group(*args, **kwargs):
            out = original(*args, **kwargs)
            try:
                _joined["world"] = max(_joined["world"], module.get_world_size())
            except Exception:  # noqa: BLE001, S110 - a report, never the rank's failure
                pass
            return out

        module.init_process_group = init_process_group

    class _Watch(_abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "torch.distributed.distributed_c10d":
                return None
            sys.meta_path.remove(self)
            spec = _util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Watch())

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
