"""Loading a packed group's flat buffer from a checkpoint, and recovering meta buffers.

:func:`block_loader` checks a group against a :class:`~aresidency.runtime.checkpoints.Checkpoint`
once, when it is built, and returns a :class:`BlockLoader`: a callable that builds the group's
flat ``uint8`` buffer (``group.nbytes`` bytes) each time it is called. Where each tensor comes
from:

* a parameter or *persistent* buffer (one in its module's ``state_dict``) from the checkpoint,
  under any of its state_dict names (a tied weight has several), or under the name ``names``
  maps one of them to (a checkpoint whose keys a model's own loader renames: transformers'
  ``save_pretrained`` writes GPT-NeoX's ``lm_head.weight`` as ``embed_out.weight``); a missing
  one is a ``KeyError`` when the loader is built, naming the checkpoint's tensors of its shape
  that the module has no name for (or, when there is none, saying the checkpoint may be in a
  layout the model's loader converts, such as Mixtral's experts saved one by one, and how to
  write one in the module's layout), never a silent fallback to the module's own tensor;
* a *non-persistent* buffer (a rotary embedding's ``inv_freq``) from the checkpoint if it holds
  it, else from the module's own tensor, read at each load; when that tensor is on the ``meta``
  device it is recovered once, when the loader is built, by :func:`recover_meta_buffers`.

Shapes must match (a ``ValueError`` naming both); floating-point dtypes may differ and are
converted during the copy (a bf16 checkpoint into a float32 module, or the reverse), but for
quantized ones (float8, float4: their values mean something only with the scale tensors saved
beside them), which must be the module's own dtype (a ``ValueError`` naming both dtypes).

What blocks: building a loader reads nothing but the headers the checkpoint already holds (and
runs the model's buffer initialisation for meta buffers). Calling it blocks the calling thread,
a worker thread, for the whole load: one pass per tensor from the file's mapping straight into
its place in the flat buffer (``TensorGroup.views``), converting the dtype in the same pass; the
only other work is the first touch of the new buffer's pages.

Measured: a block of four float32 [4096, 8192] tensors (512 MiB), the whole ``loader()`` call
timed with ``time.perf_counter``, best / median of 7, against the hand-written ``readinto``
loader this replaces. On the GPU machine's host (16 cores, Python 3.12, torch 2.11, safetensors
0.8.0), file in the page cache: 42 / 48 ms (12 GiB/s) against 318 / 341 ms (1.6 GiB/s), since
``copy_`` runs on torch's intra-op threads and ``readinto`` is one kernel copy; the same tensors
stored in bf16 into the float32 block: 42 / 52 ms. Of those 42 ms only 11 ms (12 for bf16) is the
copy: timed into an already-touched buffer; the rest is the first touch of the new buffer's
pages (128 Ki page faults), which a reused or huge-page buffer would avoid. File evicted first
(``posix_fadvise(POSIX_FADV_DONTNEED)``), disk-bound: 316 / 412 ms against 335 / 391 ms. On a
2-core VM (torch 2.13): 149 / 191 ms against 294 / 307 ms; the copy alone 30 / 33 ms. Memory: the
new flat buffer only; the file's pages stay the page cache's, mapped, not copied.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from ...runtime.checkpoints import Checkpoint, convertible, why_not_converted
from .packing import PackedTensor, TensorGroup

__all__ = [
    "BlockLoader",
    "CheckpointNames",
    "block_loader",
    "check_names",
    "recover_meta_buffers",
]

#: How the module's state_dict names map to a checkpoint's: ``{module name: checkpoint name}``,
#: or a function of the module name returning the checkpoint's (``None``: the same name).
CheckpointNames = Mapping[str, str] | Callable[[str], str | None]


def check_names(names: object, module: nn.Module) -> CheckpointNames | None:
    """``checkpoint_names=`` after checking it: ``None``, a mapping of str to str whose keys
    are ``module``'s parameter or buffer names (``ValueError`` naming those that are not: a
    typo would otherwise be a ``KeyError`` for the tensor it meant), or a callable
    (``TypeError`` for anything else)."""
    if names is None or callable(names):
        return names  # type: ignore[return-value]
    if not isinstance(names, Mapping):
        raise TypeError(
            "checkpoint_names must be a mapping from the module's state_dict names to the "
            f"checkpoint's, or a function of the name, got {type(names).__name__}"
        )
    bad = [(k, v) for k, v in names.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise TypeError(f"checkpoint_names maps str to str, got {bad[0]!r}")
    known = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    known.update(name for name, _ in module.named_buffers(remove_duplicate=False))
    unknown = sorted(set(names) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"checkpoint_names maps {', '.join(map(repr, unknown))}, not a parameter or "
            f"buffer name of {type(module).__name__}{hint}: its keys are the module's "
            "state_dict names, its values the checkpoint's"
        )
    return names


def _mapped(names: CheckpointNames | None, name: str) -> str | None:
    if names is None:
        return None
    if isinstance(names, Mapping):
        return names.get(name)
    mapped = names(name)
    if mapped is not None and not isinstance(mapped, str):
        raise TypeError(
            f"checkpoint_names({name!r}) returned {mapped!r}: the function returns the "
            "checkpoint's name for the module's tensor (a str), or None for the same name"
        )
    return mapped


def _names(entry: PackedTensor) -> str:
    if not entry.names:
        return "a tensor with no state_dict name"
    return " or ".join(repr(n) for n in entry.names)


class BlockLoader:
    """Builds one group's flat buffer (see :func:`block_loader`); called in a worker thread.

    State: ``group``, ``checkpoint``, ``reads`` (entry index, checkpoint name), ``copies``
    (entry index, the host tensor copied in: the module's own non-persistent buffer, or a
    recovered one).
    """

    def __init__(
        self,
        group: TensorGroup,
        checkpoint: Checkpoint,
        reads: list[tuple[int, str]],
        copies: list[tuple[int, torch.Tensor]],
    ) -> None:
        self.group = group
        self.checkpoint = checkpoint
        self.reads = reads
        self.copies = copies

    def __call__(self) -> torch.Tensor:
        """A new flat ``uint8`` CPU buffer of ``group.nbytes`` bytes, every tensor in place
        (the alignment padding is left uninitialised). Blocks for the reads and copies."""
        flat = torch.empty(self.group.nbytes, dtype=torch.uint8)
        views = self.group.views(flat)
        for index, name in self.reads:
            self.checkpoint.read_into(name, views[index])
        with torch.no_grad():
            for index, tensor in self.copies:
                views[index].copy_(tensor)
        return flat

    def copies_entry(self, index: int) -> bool:
        """Whether entry ``index`` is copied from a host tensor (not read from the file)."""
        return any(i == index for i, _ in self.copies)

    def set_copy(self, index: int, tensor: torch.Tensor) -> None:
        """Load entry ``index`` from ``tensor`` (a host tensor of its shape and dtype) from now
        on: a non-persistent buffer the module's forward replaced. Call while no load runs."""
        self.copies = [(i, tensor if i == index else t) for i, t in self.copies]

    def __repr__(self) -> str:
        return (
            f"<BlockLoader {self.group.name!r} {len(self.reads)} from {self.checkpoint.path}, "
            f"{len(self.copies)} from the module>"
        )


def block_loader(
    group: TensorGroup,
    checkpoint: Checkpoint,
    *,
    module: nn.Module | None = None,
    names: CheckpointNames | None = None,
) -> BlockLoader:
    """A loader of ``group``'s flat buffer from ``checkpoint``, checked now.

    ``module``: the root module the group was packed from (its state_dict names are the
    group's names); needed to recover non-persistent buffers that are on the ``meta``
    device and not in the checkpoint (see :func:`recover_meta_buffers`), and to say which of
    the checkpoint's tensors the module has no name for when one is missing. ``names``: the
    checkpoint's name for a module name (see :data:`CheckpointNames`), looked up first.

    Raises, naming the tensor's state_dict names and the checkpoint: ``KeyError`` for a
    parameter or persistent buffer missing from the checkpoint (all of them listed);
    ``ValueError`` for a shape that differs, a dtype that is not converted, or a meta buffer
    that cannot be recovered. Blocks only for looking up the checkpoint's headers (and for
    recovering meta buffers).
    """
    reads: list[tuple[int, str]] = []
    copies: list[tuple[int, torch.Tensor]] = []
    missing: list[PackedTensor] = []
    meta: list[tuple[int, PackedTensor]] = []
    for index, entry in enumerate(group.entries):
        found = _find(entry, checkpoint, names)
        if found is not None:
            info = checkpoint.info(found)
            if info.shape != entry.shape:
                raise ValueError(
                    f"{info.file}: tensor {found!r} has shape {list(info.shape)}, but the "
                    f"module's tensor {_names(entry)} has shape {list(entry.shape)}: the "
                    f"checkpoint {checkpoint.path} does not match the model"
                )
            if not convertible(info.dtype, entry.dtype):
                raise ValueError(
                    f"{info.file}: tensor {found!r} is {info.dtype}, but the module's tensor "
                    f"{_names(entry)} is {entry.dtype}, and "
                    f"{why_not_converted(info.dtype, entry.dtype)}: the checkpoint "
                    f"{checkpoint.path} does not match the model"
                )
            reads.append((index, found))
        elif entry.persistent:
            missing.append(entry)
        elif entry.tensor.is_meta:
            meta.append((index, entry))
        else:
            copies.append((index, entry.tensor.detach()))
    if missing:
        listed = "; ".join(
            _names(e) + (" (the module's is on the meta device)" if e.tensor.is_meta else "")
            for e in missing[:5]
        )
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise KeyError(
            f"checkpoint {checkpoint.path} has no tensor named {listed}{more}, needed by "
            f"{group.name}: every parameter and persistent buffer must be in the checkpoint "
            "under its state_dict name (or the name checkpoint_names= maps it to)"
            + _unclaimed_hint(missing, checkpoint, module, names)
        )
    if meta:
        if module is None:
            raise ValueError(
                f"{_names(meta[0][1])} of {group.name} is a non-persistent buffer on the meta "
                f"device and not in checkpoint {checkpoint.path}: pass module= (the root module) "
                "so that it can be recovered, or build the module with its buffers on the CPU"
            )
        wanted = [name for _, entry in meta for name in entry.names]
        recovered = recover_meta_buffers(module, names=wanted)
        for index, entry in meta:
            tensor = next((recovered[n] for n in entry.names if n in recovered), None)
            if tensor is None:  # pragma: no cover - recover_meta_buffers raises instead
                raise ValueError(f"{_names(entry)} was not recovered")
            copies.append((index, tensor))
    return BlockLoader(group, checkpoint, reads, copies)


def _find(entry: PackedTensor, checkpoint: Checkpoint, names: CheckpointNames | None) -> str | None:
    """The checkpoint's name for ``entry``: a name ``names`` maps one of its names to, else
    one of its names; ``None`` if the checkpoint has neither."""
    for name in entry.names:
        mapped = _mapped(names, name)
        if mapped is not None and mapped in checkpoint:
            return mapped
    return next((name for name in entry.names if name in checkpoint), None)


def _unclaimed_hint(
    missing: list[PackedTensor],
    checkpoint: Checkpoint,
    module: nn.Module | None,
    names: CheckpointNames | None,
) -> str:
    """What to do about ``missing``, for the ``KeyError``: the checkpoint's tensors of the
    same shape that no name of ``module`` reads (a key its own loader renames, most often),
    and how to map them; for a missing tensor with no such counterpart while the checkpoint
    holds tensors the module has no name for, that the checkpoint is in a layout the model's
    loader converts (Mixtral's experts saved one by one, fused into one tensor per layer by
    transformers), which no mapping undoes, and how to write one in the module's own layout;
    else a sentence saying the checkpoint may be another model's."""
    claimed: set[str] = set()
    if module is not None:
        for name, _ in (
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        ):
            claimed.add(name)
            mapped = _mapped(names, name)
            if mapped is not None:
                claimed.add(mapped)
    unclaimed = [name for name in checkpoint.names() if name not in claimed]
    pairs: list[tuple[str, str]] = []
    unmatched: list[str] = []
    for entry in missing:
        if not entry.names:
            continue
        same = [name for name in unclaimed if tuple(checkpoint.info(name).shape) == entry.shape]
        if not same:
            unmatched.append(entry.names[0])
            continue
        wanted = entry.names[0]
        best = max(same, key=lambda n: difflib.SequenceMatcher(None, wanted, n).ratio())
        pairs.append((wanted, best))
    if module is None or not unclaimed:
        return "; check that the checkpoint is this model's"
    hint = ""
    if pairs:
        found = ", ".join(f"{c!r} (for {w!r}?)" for w, c in pairs[:5])
        mapping = ", ".join(f"{w!r}: {c!r}" for w, c in pairs[:5])
        hint += (
            f". The checkpoint has tensors of the same shape that the module has no name for: "
            f"{found}. A model's own loader may rename keys when it loads (transformers' "
            "from_pretrained does for some models, such as GPT-NeoX's 'embed_out.weight'): if "
            f"these are the tensors, pass checkpoint_names={{{mapping}}} to stream_module (the "
            "module's state_dict name -> the checkpoint's)"
        )
    if unmatched:
        listed = ", ".join(repr(name) for name in unmatched[:3])
        more = f" (and {len(unmatched) - 3} more)" if len(unmatched) > 3 else ""
        paired = {c for _, c in pairs}
        others = [name for name in unclaimed if name not in paired] or unclaimed
        like = max(others, key=lambda n: difflib.SequenceMatcher(None, unmatched[0], n).ratio())
        hint += (
            f". No tensor of the checkpoint has the shape of {listed}{more}, while "
            f"{len(unclaimed)} of its tensors have no name in the module (such as "
            f"{like!r}): if the checkpoint is this model's, it stores them in another "
            "layout, which the model's own loader converts when it loads (transformers' "
            "from_pretrained fuses the experts of a mixture-of-experts model such as "
            "Mixtral, saved one by one, into one tensor per layer), and checkpoint_names= "
            "cannot (it maps one name to one name)"
        )
    return hint + (
        ". To write a checkpoint in the module's own names and layout, load the model and "
        "save it with model.save_pretrained(directory, save_original_format=False) "
        "(transformers 5), or safetensors.torch.save_model(model, path)"
    )


# ---------------------------------------------------------------- meta buffers


@dataclass(slots=True)
class _MetaBuffer:
    owner: nn.Module
    path: str  # the owner's qualified name (its first)
    attr: str
    tensor: torch.Tensor
    aliases: list[str] = field(default_factory=list)


def _meta_twin(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` and its children whose tensors are new meta tensors: code
    run on it (an init function) cannot touch the original's tensors."""
    twin = copy.copy(module)
    twin._parameters = {
        k: None if p is None else nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        for k, p in module._parameters.items()
    }
    twin._buffers = {
        k: None if b is None else torch.empty_like(b, device="meta")
        for k, b in module._buffers.items()
    }
    twin._modules = {k: None if m is None else _meta_twin(m) for k, m in module._modules.items()}
    return twin


def _ancestors(root: nn.Module, path: str) -> list[nn.Module]:
    """The modules on the way from ``root`` to ``path``, nearest first (``path``'s own first)."""
    chain = [root]
    if path:
        parts = path.split(".")
        for depth in range(1, len(parts) + 1):
            chain.append(root.get_submodule(".".join(parts[:depth])))
    return chain[::-1]


def _by_init_weights(
    root: nn.Module, owner: nn.Module, path: str, wanted: list[_MetaBuffer]
) -> tuple[dict[str, torch.Tensor], str]:
    """Transformers' own way: the nearest ``PreTrainedModel`` (an ancestor with ``config`` and
    ``_init_weights``) initialises the owner's buffers, given CPU placeholders, on a twin."""
    model = next(
        (m for m in _ancestors(root, path) if hasattr(m, "config") and hasattr(m, "_init_weights")),
        None,
    )
    if model is None:
        return {}, "no enclosing Hugging Face model (a module with config and _init_weights)"
    twin = _meta_twin(owner)
    placeholders: dict[str, tuple[torch.Tensor, int]] = {}
    for record in wanted:
        placeholder = torch.zeros(record.tensor.shape, dtype=record.tensor.dtype, device="cpu")
        twin._buffers[record.attr] = placeholder
        placeholders[record.attr] = (placeholder, placeholder._version)
    try:
        with torch.no_grad(), torch.device("cpu"):
            cast(Any, model)._init_weights(twin)
    except Exception as error:
        return {}, f"{type(model).__name__}._init_weights failed ({error!r})"
    # an in-place write bumps the version counter: a placeholder left alone was not initialised
    done = {
        attr: tensor
        for attr, (tensor, version) in placeholders.items()
        if tensor._version != version and twin._buffers.get(attr) is tensor
    }
    return done, f"{type(model).__name__}._init_weights does not set it"


def _by_construction(
    root: nn.Module, owner: nn.Module, path: str, wanted: list[_MetaBuffer]
) -> tuple[dict[str, torch.Tensor], str]:
    """Build the owner again on the CPU from a config (its own ``config``, else the nearest
    ancestor's): how transformers 4.x rotary modules make their buffers. Only for an owner
    without parameters (its rebuild allocates nothing large)."""
    if next(owner.parameters(), None) is not None:
        return {}, f"{type(owner).__name__} has parameters, so it is not rebuilt"
    configs: list[Any] = []
    for module in _ancestors(root, path):
        config = getattr(module, "config", None)
        if config is not None and all(config is not c for c in configs):
            configs.append(config)
    if not configs:
        return {}, "no config to rebuild it from"
    reason = "no config rebuilds it"
    for config in configs:
        try:
            with torch.no_grad(), torch.device("cpu"):
                fresh = type(owner)(config)
        except Exception as error:
            reason = f"{type(owner).__name__}(config) failed ({error!r})"
            continue
        done: dict[str, torch.Tensor] = {}
        for record in wanted:
            tensor = fresh._buffers.get(record.attr)
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.device.type == "cpu"
                and tuple(tensor.shape) == tuple(record.tensor.shape)
            ):
                done[record.attr] = tensor.detach().to(record.tensor.dtype)
        if done:
            return done, f"{type(owner).__name__}(config) makes it with another shape"
    return {}, reason


def recover_meta_buffers(
    module: nn.Module, names: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """CPU tensors for ``module``'s non-persistent buffers that are on the ``meta`` device
    (all of them, or those named in ``names``), keyed by qualified name (every alias of a
    shared module). ``module`` is left untouched.

    How: as transformers 5.x's ``from_pretrained`` does for a model built on ``meta`` (it
    replaces each non-persistent buffer by ``torch.empty_like(buffer, device=...)`` and runs
    ``initialize_weights``, whose ``_init_weights`` recomputes, e.g., every ``*RotaryEmbedding``'s
    ``inv_freq`` and ``original_inv_freq`` from ``module.config``): the nearest enclosing
    Hugging Face model's ``_init_weights`` is run on a meta twin of the buffer's module holding
    CPU placeholders, and a placeholder it wrote (its version counter moved) is the buffer.
    Failing that, a buffer's module without parameters is built again on the CPU from a config
    (its own ``config``, else the nearest ancestor's), as transformers 4.x rotary modules are.

    Blocks for running that initialisation (small tensors). Raises ``KeyError`` for a name in
    ``names`` that is not a non-persistent meta buffer, and ``ValueError`` naming each buffer
    that could not be recovered and why.
    """
    records: dict[tuple[int, str], _MetaBuffer] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        for attr in sub._non_persistent_buffers_set:
            tensor = sub._buffers.get(attr)
            if tensor is None or not tensor.is_meta:
                continue
            record = records.get((id(sub), attr))
            if record is None:
                record = records[(id(sub), attr)] = _MetaBuffer(sub, path, attr, tensor)
            record.aliases.append(f"{path}.{attr}" if path else attr)
    chosen = list(records.values())
    if names is not None:
        wanted = set(names)
        known = {alias for record in chosen for alias in record.aliases}
        unknown = sorted(wanted - known)
        if unknown:
            raise KeyError(
                f"{', '.join(map(repr, unknown))} of {type(module).__name__} is not a "
                "non-persistent buffer on the meta device"
            )
        chosen = [r for r in chosen if wanted.intersection(r.aliases)]
    by_owner: dict[int, list[_MetaBuffer]] = {}
    for record in chosen:
        by_owner.setdefault(id(record.owner), []).append(record)
    out: dict[str, torch.Tensor] = {}
    failures: list[str] = []
    with torch.inference_mode(False):  # placeholders need version counters
        for group in by_owner.values():
            owner, path = group[0].owner, group[0].path
            left = group
            reasons: list[str] = []
            for strategy in (_by_init_weights, _by_construction):
                done, reason = strategy(module, owner, path, left)
                for record in left:
                    if record.attr in done:
                        for alias in record.aliases:
                            out[alias] = done[record.attr]
                left = [r for r in left if r.attr not in done]
                if not left:
                    break
                reasons.append(reason)
            for record in left:
                failures.append(
                    f"{record.aliases[0]!r} ({type(owner).__name__}): {'; '.join(reasons)}"
                )
    if failures:
        raise ValueError(
            "non-persistent buffers on the meta device could not be recovered: "
            + ", ".join(failures)
            + ". Build the module with these buffers on the CPU (outside torch.device('meta')), "
            "or save them in the checkpoint"
        )
    return out


# ---------------------------------------------------------------- until module.py switches
