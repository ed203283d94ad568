"""``ClippedOptimizer``: settings, read-outs, state dict; the step is in ``_step/_clip_step``."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import Tensor
from torch.optim import Optimizer

from clipopt._dist._deepspeed import Watch, bind
from clipopt._dist._reduce import NormScope
from clipopt._kernels._norms import result_dtype
from clipopt._step import _clip_step, _saved
from clipopt._step._clip_step import ClipConfig, GroupView, StepRecord, check_rule_groups
from clipopt._validation import (
    CLIP_GROUP_KEY,
    CLIP_KEY,
    DEFAULT_CLIP_GROUP,
    MAX_NORM_KEY,
    NORM_TYPE_KEY,
    NonFinite,
    Settings,
    check_foreach,
    check_groups,
    clip_layout,
    validated_settings,
)
from clipopt._wrapper import OptimizerChain, OptimizerShell, check_inner, load_checked
from clipopt.rules import ClipRule, SpikeSkip, UnitWiseRule

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


def _read_only(name: str, get: Any = None, doc: str | None = None, how: str = "") -> Any:
    how = how or "it is fixed when the wrapper is made; make a new ClippedOptimizer"

    def refuse(o: object, value: object) -> NoReturn:
        raise AttributeError(f"{name} cannot be assigned ({name}={value!r}): {how}")

    return property(get or (lambda o: getattr(o._clip, name)), refuse, doc=doc)


def _group_setting(name: str, key: str) -> Any:
    def get(o: Any) -> Any:
        if name == "max_norm" and o._clip.rule is not None:
            return o._clip.rule
        values = [float(g.get(key, o.defaults[key])) for g in o.param_groups]
        return values[0] if len(set(values)) == 1 else values

    how = f"set opt.param_groups[i][{key!r}] (and opt.defaults[{key!r}] for groups added later)"
    return _read_only(name, get, how=how)


def _recorded(name: str) -> Any:
    return property(lambda o: value() if callable(value := getattr(o._record, name)) else value)


def _inner(name: str) -> Any:
    return property(
        lambda o: getattr(o.optimizer, name), lambda o, v: setattr(o.optimizer, name, v)
    )


class ClippedOptimizer(OptimizerShell):
    """Wrap any :class:`torch.optim.Optimizer` and clip the grad norm before every step.

    :meth:`step` is :func:`clipopt.clip_grad_norm_` (no host sync) then the inner step,
    whose result it returns; ``param_groups``, ``state`` and ``defaults`` are the inner
    optimizer's. A group's ``"clip_group"`` (str or int; default ``"default"``, None: not
    clipped) names its clip group, which has one norm and one threshold.

    Args:
      optimizer: the optimizer to wrap, or a list made into a :class:`clipopt.OptimizerChain`.
      max_norm: the default largest norm, > 0 (``inf``: measure only), or a group's own
        ``"clip_max_norm"`` (a number or a 0-dim tensor); or a :class:`clipopt.ClipRule`
        setting it each step (one clip group; see ``docs/adaptive.md``).
      norm_type: the order of the norm, > 0 or ``inf``, or a group's ``"clip_norm_type"``.
      per_group: clip each param group by its own norm; not with ``"clip_group"`` names.
      foreach: multi-tensor kernels (True), per-tensor ops (False) or the fastest (None).
      nonfinite: on a NaN/inf norm, ``"propagate"`` scales by NaN and steps (torch's);
        ``"skip"`` skips the step; ``"raise"`` raises :class:`clipopt.NonFiniteNormError`
        (one host read a step); ``"assert"``: ``torch._assert_async`` (on CUDA, fatal).
      max_consecutive_skips: with ``"skip"``, raise after this many skips in a row (None: never).
      process_group: the group plain parameters are split across; DTensors and DDP need none.
      replicated_params: parameters identical on every rank of ``process_group``.
      skip_spikes: a :class:`clipopt.SpikeSkip` that skips a step whose norm is a spike.
      track_tensor_norms: keep each grad's norm in :attr:`last_tensor_norms`.
      pp_mesh: the 1-D ``DeviceMesh`` or ``ProcessGroup`` joining pipeline stages.

    Raises:
      TypeError, ValueError: a bad ``optimizer`` or setting, or clip settings that disagree.

    Example:
      >>> import torch, clipopt
      >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([30.0, 40.0])
      >>> opt = clipopt.ClippedOptimizer(torch.optim.SGD([w], lr=1.0), max_norm=1.0)
      >>> opt.step()
      >>> opt.last_norm, w.grad, w.data
      (tensor(50.), tensor([0.6000, 0.8000]), tensor([-0.6000, -0.8000]))
    """

    # GradScaler unscales the grads before step() measures them: last_norm is the true norm.
    _step_supports_amp_scaling = False
    clips = True

    def __init__(
        self,
        optimizer: Optimizer | Sequence[Optimizer],
        max_norm: float | ClipRule,
        norm_type: float | str = 2.0,
        *,
        per_group: bool = False,
        foreach: bool | None = None,
        nonfinite: NonFinite = "propagate",
        max_consecutive_skips: int | None = 10,
        process_group: ProcessGroup | None = None,
        replicated_params: Iterable[Tensor] | None = None,
        skip_spikes: SpikeSkip | None = None,
        track_tensor_norms: bool = False,
        pp_mesh: DeviceMesh | ProcessGroup | None = None,
    ) -> None:
        if isinstance(optimizer, (list, tuple)):
            optimizer = OptimizerChain(optimizer)
        optimizer = check_inner(optimizer, "optimizer")
        groups = optimizer.param_groups
        if not isinstance(groups, list) or not any(g.get("params") for g in groups):
            raise ValueError(f"optimizer {type(optimizer).__name__} has no parameters to clip")
        rule = max_norm if isinstance(max_norm, ClipRule) else None
        modes = (per_group, nonfinite, max_consecutive_skips)
        settings = validated_settings(max_norm if rule is None else math.inf, norm_type, *modes)
        if rule is not None and per_group:
            raise ValueError(f"per_group=True cannot take a rule ({rule!r}): it keeps one norm")
        if isinstance(rule, UnitWiseRule):
            rule.check_norm_type(settings.norm_type)
        if not isinstance(track_tensor_norms, bool):
            raise TypeError(f"track_tensor_norms must be a bool, got {track_tensor_norms!r}")
        local = isinstance(rule, UnitWiseRule) or (rule is not None and rule.per_tensor)
        if (local or track_tensor_norms) and process_group is not None:
            why = "track_tensor_norms=True and per-tensor or unit-wise rules need unsplit"
            raise ValueError(f"{why} parameters, not a process_group")
        if skip_spikes is not None and not isinstance(skip_spikes, SpikeSkip):
            raise TypeError(f"skip_spikes must be a clipopt.SpikeSkip or None, got {skip_spikes!r}")
        check_foreach(foreach)
        check_groups(groups, settings.max_norm, settings.norm_type, per_group)
        check_rule_groups(groups, rule)
        params = [p for group in groups for p in group["params"]]
        scope = NormScope(process_group, replicated_params, params=params, pp_mesh=pp_mesh)
        # Nothing has been touched above this line.
        self._init_hooks()
        self.optimizer, self._parts = optimizer, (optimizer,)
        self._extra_saved_apart = False  # a ClippedOptimizerState carries the "clip" entry
        self._clip = ClipConfig(
            rule, skip_spikes, *modes, foreach, scope, track_tensor_norms, Watch(params)
        )
        self._apply_settings(settings)
        self._record = StepRecord()
        if len(self.clip_groups) > 1 or per_group:  # shaped from the start
            self._record.clipped_count = torch.zeros(len(self.clip_groups), dtype=torch.int64)
        # The rules' state shaped for the step's norms, so that a compiled step compiles once.
        clipped = [g for g in groups if g.get(CLIP_GROUP_KEY, DEFAULT_CLIP_GROUP) is not None]
        trained = [p for g in clipped for p in g["params"] if p.requires_grad]
        if trained:
            dtype, device = result_dtype([p.dtype for p in trained]), trained[0].device
            if rule is not None:
                shape = (len(trained),) if rule.per_tensor else ()
                rule.prepare(torch.zeros(shape, dtype=dtype, device=device))
            if skip_spikes is not None:
                skip_spikes.prepare(torch.zeros((), dtype=dtype, device=device))

    step = _clip_step.step
    param_groups = _inner("param_groups")
    state = _inner("state")
    defaults = _inner("defaults")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none)

    def _apply_settings(self, s: Settings) -> None:
        keys = {MAX_NORM_KEY: s.max_norm, NORM_TYPE_KEY: s.norm_type}
        self.defaults.update(keys)
        for group in self.param_groups:
            group.update({**keys, **group})
        modes = s.as_dict()
        del modes["max_norm"], modes["norm_type"]  # the groups and defaults hold these
        self._clip = dataclasses.replace(self._clip, **modes, view=GroupView())

    def _settings(self) -> Settings:
        c, defaults = self._clip, self.defaults
        max_norm, norm_type = float(defaults[MAX_NORM_KEY]), float(defaults[NORM_TYPE_KEY])
        return Settings(max_norm, norm_type, c.per_group, c.nonfinite, c.max_consecutive_skips)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the inner optimizer; a missing ``clip_max_norm`` or
        ``clip_norm_type`` comes from :attr:`defaults`.

        Raises:
          TypeError, ValueError: bad clip settings (as in the constructor); nothing is added.
        """
        if isinstance(param_group, dict):
            s, groups = self._settings(), [*self.param_groups, param_group]
            check_groups(groups, s.max_norm, s.norm_type, s.per_group)
            check_rule_groups(groups, self._clip.rule)
        self.optimizer.add_param_group(param_group)
        self._clip.deepspeed.add(self.param_groups[-1]["params"])

    def attach_deepspeed(self, engine: Any) -> None:
        """Say that DeepSpeed's ``engine`` steps this wrapper: call it once, right after
        ``deepspeed.initialize(optimizer=this wrapper, ...)``.

        Raises:
          ValueError: the engine does not step this wrapper, or a setting (named) makes
            the norm wrong; nothing changes.
        """
        if isinstance(self.optimizer, OptimizerChain):
            raise ValueError("DeepSpeed steps one optimizer, not an OptimizerChain")
        self._clip.deepspeed.binding = bind(engine, self)

    def __repr__(self) -> str:
        shown = self._settings().as_dict()
        shown.update(max_norm=self.max_norm, norm_type=self.norm_type)
        if self._clip.skip_spikes is not None:
            shown["skip_spikes"] = self._clip.skip_spikes
        settings = ", ".join(f"{k}={v!r}" for k, v in shown.items())
        return f"{type(self).__name__}({settings}) wrapping\n{self.optimizer!r}"

    per_group = _read_only("per_group", doc="Whether each param group is clipped by its own norm.")
    foreach = _read_only("foreach", doc="The ``foreach`` choice of the norm and scale kernels.")
    nonfinite = _read_only("nonfinite", doc="What a non-finite norm does (see the constructor).")
    max_consecutive_skips = _read_only(
        "max_consecutive_skips", doc="Skips in a row before a raise."
    )
    rule = _read_only("rule", doc="The clip rule passed as ``max_norm``, None for a number.")
    skip_spikes = _read_only("skip_spikes", doc="The :class:`clipopt.SpikeSkip`, or None.")
    track_tensor_norms = _read_only(
        "track_tensor_norms", doc="Whether a step keeps its tensors' norms."
    )

    max_norm: float | list[float] | ClipRule = _group_setting("max_norm", MAX_NORM_KEY)
    """The rule, else the groups' ``clip_max_norm`` (one number where all are equal);
    read-only: set ``opt.param_groups[i]["clip_max_norm"]``, as a scheduler sets ``lr``."""

    norm_type: float | list[float] = _group_setting("norm_type", NORM_TYPE_KEY)
    """The groups' ``clip_norm_type``, read-only as :attr:`max_norm`."""

    last_norm: Tensor | None = _recorded("last_norm")
    """The last step's pre-clip total norm, 0-dim on the grads' device; None before one."""

    last_group_norms: Tensor | None = _recorded("last_group_norms")
    """Each clip group's pre-clip norm (1-D, as :attr:`clip_groups`), else None."""

    @property
    def clip_groups(self) -> tuple[str | int, ...]:
        """The clip groups' names (the group indices with ``per_group=True``)."""
        layout = clip_layout(self.param_groups)
        if layout is not None:
            return tuple(layout[1])
        return tuple(range(len(self.param_groups))) if self.per_group else (DEFAULT_CLIP_GROUP,)

    last_clipped_norm: Tensor | None = _recorded("last_clipped_norm")
    """The post-clip norm, shaped as the norm; None before a step, after a format-1 load, and
    where groups with different ``clip_max_norm`` share one norm."""

    last_clipped: Tensor | None = _recorded("last_clipped")
    """Whether the last step's clip scaled (some of) the grads, shaped as the norm."""

    clipped_count: Tensor = _recorded("clipped_count")
    """Steps whose clip scaled the grads, an int64 tensor shaped as :attr:`last_clipped`."""

    @property
    def last_tensor_norms(self) -> dict[str, Tensor] | None:
        """With ``track_tensor_norms``, ``{param_names entry or str index: pre-clip norm}``
        of the last step's grads; None before a step."""
        norms, names = self._record.tensor_norms, self._record.tensor_names
        return None if norms is None else dict(zip(names, norms.unbind(), strict=True))

    step_count: Tensor = _recorded("step_count")
    """Inner steps taken, a 0-dim int64 tensor."""
    skip_count: Tensor = _recorded("skip_count")
    """Steps skipped for a non-finite norm, a 0-dim int64 tensor."""
    consecutive_skips: Tensor = _recorded("consecutive_skips")
    """Steps skipped in a row, a 0-dim int64 tensor."""

    def _state_dict(self) -> dict[str, Any]:
        return {**self.optimizer.state_dict(), CLIP_KEY: self._extra_state()}

    def _extra_state(self) -> dict[str, Any]:
        c, record = self._clip, self._record.state()
        return _saved.clip_entry(self._settings(), record, c.rule, c.skip_spikes)

    def _load(self, loaded: dict[str, Any], inner: bool = True) -> None:
        if CLIP_KEY not in loaded and not self._extra_saved_apart:
            warnings.warn(
                f"a state dict without a {CLIP_KEY!r} entry: the clip state stays; save "
                "clipopt.distributed.ClippedOptimizerState(optimizer) too",
                stacklevel=3,
            )
        extra, c = loaded.pop(CLIP_KEY, None), self._clip
        # The entry has a norm per saved clip group (the inner optimizer judges odd groups).
        groups: Any = loaded.get("param_groups")
        readable = isinstance(groups, list) and all(isinstance(g, dict) for g in groups)
        if not readable or len(groups) != len(self.param_groups):
            groups = self.param_groups
        layout = clip_layout(groups)
        count = len(groups) if layout is None else len(layout[1])
        prepared = _saved.check_load(extra, loaded, count, self._settings(), c.rule, c.skip_spikes)
        if inner:
            load_checked(self.optimizer, loaded)
        # An inner optimizer's own layout loads groups that only now can be read.
        s = self._settings() if prepared is None else prepared.settings
        check_groups(self.param_groups, s.max_norm, s.norm_type, s.per_group)
        if prepared is not None:
            device = next(p.device for group in self.param_groups for p in group["params"])
            for mine, saved in ((c.rule, prepared.rule), (c.skip_spikes, prepared.skip_spikes)):
                if mine is not None and saved is not None:
                    mine.load_state_dict(saved)
                    mine.to(device)
            counters = {k: v.to(device, copy=True) for k, v in prepared.counters.items()}
            last = {
                k: t if t is None else t.to(device, copy=True) for k, t in prepared.last.items()
            }
            self._record.load(counters, last)
        self._apply_settings(s)


setattr(ClippedOptimizer.step, "hooked", True)  # noqa: B010  torch's hook wrapper: see clipopt._wrapper
