"""A model's state (modes, buffers, submodules, attributes, registrations) as it was at one point, to run again from
there or to give it back: a capture and a replay leave the caller's model as they found it (:func:`model_kept`);
every rank of a multi-rank replay starts from the same state, and so do the rounding check's float64 rerun and the
replay itself after ``--map auto``'s alignment run."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final, TypeVar

import torch
from torch.utils.hooks import RemovableHandle

from parity_harness.capture.observe.containers import (
    MAX_KEPT_BYTES,
    CopyBudget,
    HeldItems,
    dense,
    hold,
    holds,
    is_container,
    put_back,
    replace_tensors,
    storage_address,
    version_of,
    written_back,
)

__all__ = ["BufferState", "aliases_following", "model_kept"]

_Copies = dict[int, torch.Tensor]
"""Copies of tensor attributes' values, by the id of the tensor."""


@dataclass(frozen=True)
class _ModuleState:
    module: torch.nn.Module
    buffers: dict[str, tuple[torch.Tensor, torch.Tensor | None] | None]
    """Name -> (the buffer tensor it held, a copy of its values; None where they cannot be read: its storage freed);
    None for an entry that was None."""
    non_persistent: frozenset[str]
    children: dict[str, torch.nn.Module | None]
    attributes: _Attributes
    versions: dict[str, int]
    """Buffers whose values were not copied: name -> version counter then."""


@dataclass(frozen=True)
class _Attributes:
    """A module's own attributes (not torch's) and its registrations, as they were."""

    plain: dict[str, tuple[object, torch.Tensor | None]]
    """Attributes holding a number, a string, None or a tensor (a step counter kept as ``self.steps``, the private
    flag that says it was made): name -> (the object, a copy of a dense tensor's values; None: not copied)."""
    unkept: dict[str, int]
    """Tensor attributes too large to copy (a preallocated cache): name -> the tensor's version counter then."""
    containers: dict[str, tuple[object, HeldItems | None]]
    """Attributes holding a list, dict, set or tuple (a history a forward appends to): name -> (the object, what it
    held; None for one too large to keep, which keeps whatever it holds then)."""
    others: dict[str, object]
    """Every other attribute of its own (a hook's handle, a config object): name -> the object (not a copy)."""
    names: tuple[str, ...]
    """Every attribute's name then, torch's own included: those added since are the only ones that may go."""
    registrations: _Registrations
    generators: dict[str, tuple[torch.Generator, torch.Tensor]] = dataclasses.field(default_factory=dict)
    """Attributes holding a ``torch.Generator`` of the module's own (noise drawn in the forward): name -> (the
    generator, its state then). Put back with the generator, so that a run from this state draws what the run from it
    drew."""

    @classmethod
    def of(
        cls,
        module: torch.nn.Module,
        memo: dict[int, HeldItems],
        own: frozenset[int],
        copies: _Copies | None,
        budget: CopyBudget,
    ) -> _Attributes:
        """``copies``: copy the plain tensors' values (to put them back later; a tensor several modules hold, once:
        by its id) or, None, not (to swap copies in)."""
        plain: dict[str, tuple[object, torch.Tensor | None]] = {}
        unkept: dict[str, int] = {}
        containers: dict[str, tuple[object, HeldItems | None]] = {}
        others: dict[str, object] = {}
        generators: dict[str, tuple[torch.Generator, torch.Tensor]] = {}
        for name, value in vars(module).items():
            if name in _TORCH_OWN:
                continue
            if isinstance(value, torch.Generator):
                generators[name] = (value, value.get_state())
            if isinstance(value, _PLAIN):
                copy = None if copies is None else _copy_of(value, copies, own, budget)
                if copies is not None and copy is None and isinstance(value, torch.Tensor) and id(value) not in own:
                    unkept[name] = version_of(value)
                plain[name] = (value, copy)
            elif is_container(value):
                containers[name] = (value, hold(value, memo, own, budget))
            else:
                others[name] = value
        return cls(plain, unkept, containers, others, tuple(vars(module)), _Registrations.of(module), generators)

    def put_back(
        self,
        module: torch.nn.Module,
        copies: bool = False,
        standing_in: dict[int, torch.Tensor] | None = None,
        weights: frozenset[int | None] | None = None,
    ) -> None:
        """The module's attributes as they were, those it made since removed (:func:`_made_here`; after every
        module's registrations, which decide whether a hook's handle goes); its containers are put back apart
        (:meth:`put_back_containers`), once every module's buffers hold their values. ``copies``: a tensor attribute
        gets a copy of its saved values whatever it holds (for a run that may move it); one that is the model's own
        buffer, the copy in ``standing_in`` the run runs with. ``weights``: give the model back (its parameters'
        storages): a tensor that changed in place gets its values back in place (``containers.written_back``)."""
        held = module.__dict__
        for name in [name for name in held.keys() - self.names if _made_here(name, held[name])]:
            del held[name]
        held.update(self.others)
        for generator, state in self.generators.values():
            generator.set_state(state)  # the object put back above, unless another attribute holds it now
        for name, (value, values) in self.plain.items():
            if values is None or (not copies and holds(value, values)):
                held[name] = standing_in.get(id(value), value) if standing_in else value
                continue
            if weights is not None and (_on_weights(value, weights) or written_back(value, values, weights)):
                held[name] = value  # on a parameter's memory: as the parameter, the run's values (never a copy)
                continue
            wants_grad = isinstance(value, torch.Tensor) and value.requires_grad
            held[name] = values.clone().requires_grad_(wants_grad)

    def put_back_containers(
        self,
        module: torch.nn.Module,
        done: set[int],
        standing_in: dict[int, torch.Tensor] | None = None,
        weights: frozenset[int | None] | None = None,
    ) -> None:
        """Each container attribute the object it was, holding what it held (in place: whatever else holds it sees
        the same; ``standing_in`` and ``weights`` as for ``containers.put_back``)."""
        for name, (container, held) in self.containers.items():
            if held is not None:
                put_back(held, done, standing_in, weights)
            module.__dict__[name] = container

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor an attribute holds, itself or in a container (a few levels deep), with the attribute's name."""
        for name, (value, _) in self.plain.items():
            if isinstance(value, torch.Tensor):
                yield name, value
        for name, (_, held) in self.containers.items():
            if held is not None:  # not one too large to keep
                yield from ((name, tensor) for tensor in held.tensors())

    def moved_unkept(self) -> Iterator[str]:
        """The names of tensor attributes, and of containers holding a tensor, too large to copy that changed since
        (their version moved)."""
        for name, version in self.unkept.items():
            if version_of(self.plain[name][0]) != version:  # type: ignore[arg-type]
                yield name
        for name, (_, held) in self.containers.items():
            if held is not None and held.moved():
                yield name


@dataclass(frozen=True)
class BufferState:
    """Every module's buffers, submodules, plain counters, containers and registrations: a forward may register a
    buffer, fill one that was None, put another tensor in a buffer's place (even a view of a weight), create a
    submodule holding a counter, count its steps in an attribute, append to a list it holds
    (:mod:`~parity_harness.capture.observe.containers`), or set itself up once, registering a hook or a weight norm
    and noting so in a flag, a list or the hook's handle: the hooks registered and the parameters replaced since go
    with them, or the next run would set itself up a second time. The objects other attributes hold are put back as
    those objects, not copies."""

    modules: tuple[_ModuleState, ...]
    versions: dict[int, int] = dataclasses.field(default_factory=dict)
    """Each buffer's and tensor attribute's version counter then, by the tensor's id."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> BufferState:
        """``model``'s buffers and submodules as they are now (a TorchScript module's are its compiled code's)."""
        modules = [m for m in model.modules() if not isinstance(m, torch.jit.ScriptModule)]
        memo: dict[int, HeldItems] = {}  # a container held by several attributes is kept once
        own = _own_tensors(modules)
        copies: _Copies = {}
        budget = CopyBudget()
        state = cls(tuple(_state_of(module, memo, own, copies, budget) for module in modules))
        state.versions.update((id(tensor), version_of(tensor)) for _, tensor in state._buffers_and_attributes())
        return state

    def moved_unkept(self) -> str | None:
        """The name of a buffer or attribute too large to copy that changed since (a run cannot start from this
        state), if any."""
        for state in self.modules:
            for name, saved in state.buffers.items():
                if saved is not None and saved[1] is None and version_of(saved[0]) != state.versions.get(name):
                    return name
        return next((name for state in self.modules for name in state.attributes.moved_unkept()), None)

    def view_of_written_buffer(self) -> str | None:
        """A buffer or attribute, described, (a tensor it holds, or one in a container) that shares a buffer's memory
        without being that buffer (``self.k = self.cache[0]``), where the run since wrote that memory, if any: a run
        that puts float64 copies in the buffers' places leaves such a view reading the float32 values the run
        changes. Not a view of a parameter (its float64 copy holds the same values, and no forward writes it), an
        empty tensor, nor memory the run left alone (a mask's rows)."""
        buffers: dict[int | None, list[torch.Tensor]] = {}
        for name, tensor in self._buffers_and_attributes():
            if name.startswith("buffer ") and tensor.numel():
                buffers.setdefault(storage_address(tensor), []).append(tensor)
        buffers.pop(None, None)
        for name, tensor in self._buffers_and_attributes():
            sharing = [other for other in buffers.get(storage_address(tensor), []) if other is not tensor]
            now = version_of(tensor)
            if tensor.numel() and sharing and now != self.versions.get(id(tensor), now):
                return name  # a view shares its base's version counter: moved, the memory was written
        return None

    def _buffers_and_attributes(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each buffer and tensor attribute of every module as they were kept, described (``buffer 'mem'``,
        ``attribute 'keys'``)."""
        for state in self.modules:
            for name, saved in state.buffers.items():
                if saved is not None:
                    yield f"buffer {name!r}", saved[0]
            yield from ((f"attribute {name!r}", tensor) for name, tensor in state.attributes.tensors())

    def generators(self) -> list[torch.Generator]:
        """The generators the model's modules held as attributes: :meth:`restore` and :meth:`applied` put them back in
        the states they held then (``record.draws.SameDraws`` takes draws from them as the run's)."""
        return [generator for module in self.modules for generator, _ in module.attributes.generators.values()]

    def values_of(self, buffer: torch.Tensor) -> torch.Tensor | None:
        """The copy of ``buffer``'s values this state holds (never written), if it is one of the model's buffers."""
        return self._copies.get(id(buffer))

    @functools.cached_property
    def _copies(self) -> dict[int, torch.Tensor | None]:
        saved = (entry for state in self.modules for entry in state.buffers.values() if entry is not None)
        return {id(buffer): values for buffer, values in saved}

    def restore(self) -> None:
        """The model back to this state: each buffer the tensor it was, holding the values it had (written only
        where they changed; never into a tensor the run put in its place), None entries None, buffers, submodules
        and attributes added since removed, those removed put back."""
        done: set[int] = set()
        params = (param for state in self.modules for param in state.module._parameters.values())
        weights = frozenset(storage_address(param) for param in params if param is not None)
        with torch.no_grad():
            for state in self.modules:  # first: a handle whose hook goes, goes with it
                state.attributes.registrations.put_back(state.module)
            for state in self.modules:
                module = state.module
                _replace(module._modules, state.children)
                restored_buffers = {
                    name: None if saved is None else _restored(*saved) for name, saved in state.buffers.items()
                }
                _replace(module._buffers, restored_buffers)
                module._non_persistent_buffers_set = set(state.non_persistent)
                state.attributes.put_back(module, weights=weights)
            for state in self.modules:  # once every buffer holds its values: a list may hold one
                state.attributes.put_back_containers(state.module, done, weights=weights)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Copies of this state's values in the model for the duration (its submodules as they were); the model's
        own buffers, submodules and attributes afterwards, untouched."""
        modules = [state.module for state in self.modules]
        memo: dict[int, HeldItems] = {}
        own = _own_tensors(modules)
        now = [(m, dict(m._buffers), dict(m._modules), set(m._non_persistent_buffers_set)) for m in modules]
        budget = CopyBudget()
        attributes = [_Attributes.of(m, memo, own, None, budget) for m in modules]
        standing_in: dict[int, torch.Tensor] = {}
        """The saved buffers, by id -> the copies the rerun runs with (a list holding one gets the copy)."""
        moved = self.moved_unkept()
        if moved is not None:
            raise RuntimeError(f"{moved}: too large to keep, and changed since: the run cannot start as the replay did")
        try:
            for state in self.modules:
                _replace(state.module._modules, state.children)
                copies = {name: None if saved is None else _copy(*saved) for name, saved in state.buffers.items()}
                for saved, copy in zip(state.buffers.values(), copies.values(), strict=True):
                    if saved is not None and copy is not None:
                        standing_in[id(saved[0])] = copy
                _replace(state.module._buffers, copies)
                state.module._non_persistent_buffers_set = set(state.non_persistent)
                state.attributes.put_back(state.module, copies=True, standing_in=standing_in)
            applied: set[int] = set()
            for state in self.modules:
                state.attributes.put_back_containers(state.module, applied, standing_in)
            yield
        finally:
            done: set[int] = set()
            for module, held in zip(modules, attributes, strict=True):
                held.registrations.put_back(module)
            for (module, buffers, children, names), held in zip(now, attributes, strict=True):
                _replace(module._modules, children)
                _replace(module._buffers, buffers)
                module._non_persistent_buffers_set = names
                held.put_back(module)
            for module, held in zip(modules, attributes, strict=True):
                held.put_back_containers(module, done)


@contextlib.contextmanager
def model_kept(model: torch.nn.Module) -> Iterator[BufferState]:
    """The caller's model as it was once the block is over: each module's train/eval mode, its parameters' tensors
    (a replay's ``--dtype`` casts them), its buffers, submodules and attributes (a train-mode run moves BatchNorm's
    statistics, fills a buffer that was None, makes a counter). Gradients stay: they are the run's. A test capturing
    one model twice, or checking it against two bundles, would otherwise run the second time from what the first
    left, and a port loaded from the reference's ``state_dict`` after a capture would start from moved statistics.
    Yields the state kept (its copies of the buffers' values are there to read)."""
    modes = [(module, module.training) for module in model.modules()]
    parameters = [(param, param.data) for param in model.parameters()]
    buffers = BufferState.of(model)

    def give_back() -> None:
        for module, training in modes:
            module.training = training
        with torch.no_grad():
            for param, data in parameters:
                if not _same_memory(param, data):
                    if (param.dtype, param.device) != (data.dtype, data.device):
                        param.grad = None  # of the cast tensor's dtype
                    param.data = data
        buffers.restore()

    try:
        yield buffers
    except BaseException:
        with contextlib.suppress(Exception):  # the run's own error is the one to see, not one of putting things back
            give_back()
        raise
    give_back()


def _same_memory(param: torch.Tensor, data: torch.Tensor) -> bool:
    """Whether a parameter still holds ``data`` (``.data`` is a new wrapper at each access: compared by what it
    holds); a parameter that cannot say (a lazy module's, made during the run) is left as the run left it."""
    try:
        now = (param.dtype, param.device, param.data_ptr(), param.shape, param.stride(), param.storage_offset())
        return now == (data.dtype, data.device, data.data_ptr(), data.shape, data.stride(), data.storage_offset())
    except (RuntimeError, ValueError):
        return True


Swapped = TypeVar("Swapped")


@contextlib.contextmanager
def aliases_following(model: torch.nn.Module, swap: contextlib.AbstractContextManager[Swapped]) -> Iterator[Swapped]:
    """``swap`` entered (it puts other tensors in the model's buffers' places: float64 copies for the rounding check's
    rerun), with every attribute and container item of the model that held a buffer so replaced holding its
    replacement for the duration: a module keeping its buffer in a list reads what its forward moves."""
    modules = list(model.modules())
    before = {(id(m), name): t for m in modules for name, t in m._buffers.items() if t is not None}
    with swap as swapped:
        replacements = {
            id(before[(id(m), name)]): t
            for m in modules
            for name, t in m._buffers.items()
            if (id(m), name) in before and t is not before[(id(m), name)] and t is not None
        }
        undo: list[Callable[[], None]] = []
        try:
            if replacements:
                for module in modules:
                    _replace_in_attributes(module, replacements, undo)
            yield swapped
        finally:
            for step in reversed(undo):
                step()


def _replace_in_attributes(
    module: torch.nn.Module, replacements: dict[int, torch.Tensor], undo: list[Callable[[], None]]
) -> None:
    held = module.__dict__
    for name, value in list(held.items()):
        if name in _TORCH_OWN:
            continue
        if isinstance(value, torch.Tensor) and id(value) in replacements:
            held[name] = replacements[id(value)]
            undo.append(functools.partial(held.__setitem__, name, value))
        elif is_container(value):
            replace_tensors(value, replacements, undo)


def _own(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """A module's own parameters and buffers."""
    for tensor in [*module._parameters.values(), *module._buffers.values()]:
        if tensor is not None:
            yield tensor


def _own_tensors(modules: list[torch.nn.Module]) -> frozenset[int]:
    """The ids of the modules' parameters and buffers: a container holding one keeps it as the object it is."""
    held = (tensors for m in modules for tensors in (m._parameters, m._buffers))
    return frozenset(id(tensor) for tensors in held for tensor in tensors.values() if tensor is not None)


def _state_of(
    module: torch.nn.Module, memo: dict[int, HeldItems], own: frozenset[int], copies: _Copies, budget: CopyBudget
) -> _ModuleState:
    outside = module._non_persistent_buffers_set
    buffers = {
        name: None if buffer is None else (buffer, _buffer_copy(buffer, name in outside, budget))
        for name, buffer in module._buffers.items()
    }
    return _ModuleState(
        module,
        buffers,
        frozenset(module._non_persistent_buffers_set),
        dict(module._modules),
        _Attributes.of(module, memo, own, copies, budget),
        {name: version_of(saved[0]) for name, saved in buffers.items() if saved is not None and saved[1] is None},
    )


@dataclass(frozen=True)
class _Registrations:
    """A module's class, its parameters (the objects registered) and the hooks registered on it."""

    kind: type
    parameters: dict[str, torch.nn.Parameter | None]
    hooks: dict[str, frozenset[int]]
    """Each of torch's hook dicts that held any -> the ids of the hooks it held."""

    @classmethod
    def of(cls, module: torch.nn.Module) -> _Registrations:
        held = vars(module)
        hooks = {name: frozenset(held[name]) for name in _HOOK_DICTS if held.get(name)}  # most are empty
        return cls(type(module), dict(module._parameters), hooks)

    def put_back(self, module: torch.nn.Module) -> None:
        """The class and parameters it had (a parametrization or a weight norm set up since undone), and the hooks
        registered since taken off (those it had stay: a hook a forward removes, as a lazy module's initialiser,
        is not put back)."""
        if type(module) is not self.kind:
            module.__class__ = self.kind
        if module._parameters.keys() != self.parameters.keys() or any(
            module._parameters[name] is not param for name, param in self.parameters.items()
        ):
            _replace(module._parameters, self.parameters)
        held = vars(module)
        for name in _HOOK_DICTS:
            registered, ids = held.get(name), self.hooks.get(name, frozenset())
            if registered and registered.keys() != ids:
                for added in [key for key in registered if key not in ids]:
                    del registered[added]


def _made_here(name: str, value: object) -> bool:
    """Whether an attribute a forward added goes when the module is put back: a plain value or a container, or the
    handle of a hook the restore took off (another handle, of a hook on a tensor, stays with its hook: the forward
    that checks for it would register the hook again); never torch's own."""
    if name in _TORCH_OWN:
        return False
    if isinstance(value, _PLAIN) or is_container(value) or isinstance(value, torch.Generator):
        return True  # a generator too: one made on the first call is made again, at its seed, by the next run
    if isinstance(value, RemovableHandle):
        hooks = value.hooks_dict_ref()
        return hooks is None or value.id not in hooks
    return False


_PLAIN: Final = (int, float, bool, str, type(None), torch.Tensor)
_TORCH_OWN: Final = frozenset(vars(torch.nn.Module()))
"""What every module holds for torch itself (its mode, parameters, buffers, submodules and hook dicts): put back as
registrations (:class:`_Registrations`) and buffers, the mode by the caller, never as attributes."""
_HOOK_DICTS: Final = tuple(name for name in _TORCH_OWN if "hook" in name and name != "_is_full_backward_hook")


def _replace(target: dict, entries: dict) -> None:  # type: ignore[type-arg]
    """``target`` (a module's own ordered dict) holding exactly ``entries``, in their order."""
    target.clear()
    target.update(entries)


def _restored(buffer: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
    """The buffer tensor a module had, holding ``values`` (a copy of what it held then; None: not copied): written
    back only where they changed (BatchNorm's kernels update running statistics in place without moving the version
    counter), and where it cannot be written (an expanded or inference-mode tensor, or one resized since, which
    nothing wrote in place either) a copy of ``values`` instead."""
    if values is None or holds(buffer, values) or written_back(buffer, values, frozenset()):
        return buffer
    return values.clone()


def _copy(buffer: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
    """A copy of a buffer's saved values for a rerun; the buffer itself where they could not be read."""
    return buffer if values is None else values.clone()


def _buffer_copy(buffer: torch.Tensor, non_persistent: bool, budget: CopyBudget) -> torch.Tensor | None:
    """A copy of a buffer's values, or None where they cannot be read (sparse, on the meta device, its storage
    freed) or, for a buffer outside the state dict (a precomputed table, mostly), where it is larger than what is
    left of the budget (its version counter is watched instead)."""
    if not dense(buffer) or (non_persistent and not budget.take(buffer, largest=MAX_KEPT_BYTES)):
        return None  # sparse, meta or freed: kept as the object it is
    return buffer.detach().clone()


def _on_weights(value: object, weights: frozenset[int | None]) -> bool:
    return isinstance(value, torch.Tensor) and storage_address(value) in weights


def _copy_of(value: object, copies: _Copies, own: frozenset[int], budget: CopyBudget) -> torch.Tensor | None:
    """A copy of a tensor attribute's values (one per tensor, however many modules hold it), or None: not a dense
    tensor, the model's own (its values come back with the model's), or too large to copy."""
    if not isinstance(value, torch.Tensor) or id(value) in own or not dense(value):
        return None
    if id(value) not in copies:
        if not budget.take(value, largest=MAX_KEPT_BYTES):  # an attribute is state more often than a list's tensor
            return None
        copies[id(value)] = value.detach().clone()
    return copies[id(value)]
