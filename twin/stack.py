"""The twin's stack between two `pulumi up`s: what Pulumi's engine keeps and decides, which the mocks lack.

Each resource's state (id, inputs, outputs) stays from one apply to the next. At the next, a property the program
lists in a resource's ignore_changes keeps its old value, as the engine does; a resource whose inputs are then the
same is left as it is, a changed one is updated (twin.program makes and updates them on moto), and a type
in ``replace`` is replaced whatever its inputs (`pulumi up --replace`). A dynamic resource (infra/amis.py's
AmiCleanup) runs its own provider, unpickled as the engine does: its create; at an update its diff, and for a
replacement the new one's create and then the old one's delete, after everything that named it moved.
"""
from __future__ import annotations

import base64
from collections.abc import Callable, Iterable

DYNAMIC = "pulumi-python:dynamic:Resource"
Key = tuple[str, str]  # (type, logical name)
State = tuple[str, dict, dict]  # (id, inputs, outputs)


class Stack:
    def __init__(self):
        self.state: dict[Key, State] = {}
        self.ignores: dict[Key, list[str]] = {}  # each resource's ignore_changes, as the program declared them
        self.changed: list[str] = []  # "type name" that the last apply updated or replaced
        self.replace: set[str] = set()
        self._deletes: list[Callable[[], None]] = []

    def begin(self, replace: Iterable[str] = ()) -> None:
        self.changed, self.replace, self._deletes = [], set(replace), []

    def finish(self) -> None:
        """The replaced resources' deletes, last, as the engine runs them (create before delete)."""
        for delete in self._deletes:
            delete()

    def register(self, typ: str, name: str, inputs: dict,
                 make: Callable[[str, str, dict, State | None], tuple[str, dict]]) -> tuple[str, dict]:
        """One resource of this apply: ``make`` creates it, or updates it from its state (then not None)."""
        key, was = (typ, name), self.state.get((typ, name))
        if was is not None:
            inputs = {**inputs, **{k: was[1][k] for k in self.ignores.get(key, ()) if k in was[1]}}
            if inputs == was[1] and typ not in self.replace:
                return was[0], was[2]
            self.changed.append(f"{typ} {name}")
        rid, outputs = self._dynamic(inputs, was) if typ == DYNAMIC else make(typ, name, inputs, was)
        self.state[key] = (rid, inputs, outputs)
        return rid, outputs

    def _dynamic(self, inputs: dict, was: State | None) -> tuple[str, dict]:
        import dill

        def provider(props: dict):  # a secret: under the mocks, in its wire form {sig: ..., "value": ...}
            pickled = props["__provider"]
            return dill.loads(base64.b64decode(pickled["value"] if isinstance(pickled, dict) else pickled))

        if was is not None:
            diff = provider(inputs).diff(was[0], was[2], inputs)
            if not diff.replaces:  # the program's one dynamic resource has no update: replaced, or left as it is
                return was[0], {**was[2], **inputs}
            old = provider(was[2])
            if diff.delete_before_replace:
                old.delete(was[0], was[2])
            else:
                self._deletes.append(lambda: old.delete(was[0], was[2]))
        made = provider(inputs).create(inputs)
        return made.id, {**(made.outs or {}), "__provider": inputs["__provider"]}


def monitor(stack: Stack):
    """The mock monitor, also keeping each resource's ignore_changes (a resource's options never reach the mocks)."""
    from pulumi.runtime.mocks import MockMonitor

    class Monitor(MockMonitor):
        def RegisterResource(self, request):
            stack.ignores[(request.type, request.name)] = list(request.ignoreChanges)
            return super().RegisterResource(request)

    return Monitor
