"""The engine: one object under every front door (CLI, service, bench, ComfyUI nodes).

An `Engine` resolves where its components are (`ComponentPaths`: today's per-mode download, the older
root layout, or one path per component), loads each once with one progress callback, configures each
DiT and the video VAE with the kernels once and keeps the reports, owns the caches (prompts in the text
encoder, references and keyframes in the pipeline, AdaLN tables and step caches in the sampling), and
runs the pipeline's stages: text encode, reference/keyframe encode, sample, decode, mux, or all of them
in `generate`. Under a VRAM budget it places the models for a smaller card (memory.py: streamed DiT blocks
and text-encoder layers, VAEs visiting for their stages). A front door only turns its own inputs (flags,
HTTP JSON, ComfyUI types) into these calls.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch

from ...errors import H3Error, InputError
from ..pipeline.generation import DEFAULT_ENCODE_TILE, Components, GenerationRequest, GenerationResult, Pipeline
from .cuda_allocator import choose_allocator
from .job_attention import AttentionChoice, choose_attention, running
from .loading import LOADED, MODE_PARTITIONS, LoadOptions, check_device, check_fit, component_loader
from .paths import ComponentPaths


@dataclass
class LoadEvent:
    """One component's loading news: state is "loading", "resident" (with seconds) or "failed" (with error)."""

    component: str
    state: str
    seconds: float | None = None
    error: str | None = None


ProgressFn = Callable[[LoadEvent], None]


class Engine:
    def __init__(self, paths: ComponentPaths | None = None, options: LoadOptions | None = None, *,
                 overrides: Mapping[str, Callable[[], object]] | None = None,
                 components: Components | None = None, offload_text_encoder: bool = False,
                 release_adaln: bool = False):
        self.paths = paths or ComponentPaths()
        self.options = options or LoadOptions()
        self.overrides = dict(overrides or {})
        unknown = sorted(set(self.overrides) - set(LOADED))
        if unknown:
            raise InputError(f"unknown component override(s) {unknown}; components are {', '.join(LOADED)}")
        self.components = components or Components(device=self.options.device)
        # Per DiT key ("dit", "dit_ref"): the apply_kernels report and the attention + Q/K preparation it set;
        # "vae": the decoder's (apply_vae_kernels).
        self.kernel_reports: dict[str, dict] = {}
        self.default_attention: dict[str, tuple[object, object]] = {}
        self.load_seconds: dict[str, float] = {}
        self.checkpoint_formats: dict[str, str] = {}
        # Per DiT key, under a VRAM budget: which blocks stay resident and which stream (memory.py); and the
        # GPU bytes kept free for the other stages (text encode, VAE).
        self.memory_plans: dict[str, object] = {}
        self.stage_reserve: dict[str, int] = {}
        # Under a budget: the VAEs and text encoder (layers) its spare room keeps on the GPU beside DiTs resident
        # whole (memory.keep_on_device); None without a budget.
        self.kept_on_device = None
        self.auto_budget: dict | None = None  # what `--vram-budget auto` chose, when it was asked
        self.host_plan: dict | None = None  # under a budget: what the models hold in host memory (memory.check_host)
        # Static NVFP4 activation scales (H3_NVFP4_STATIC_SCALES), checked in preflight, installed in _configure:
        # DiT key -> artifact. model_ids: what names a DiT built in memory (a synthetic recipe), for its hash.
        self.static_artifacts: dict[str, object] = {}
        self.model_ids: dict[str, str] = {}
        # Device bytes a ControlNet checked before the load needs at least, its blocks streamed (check_controlnet).
        self.controlnet_reserve = 0
        # The loaded tower's plan under a VRAM budget (how many of its blocks are resident / streamed), or None.
        self.controlnet_plan = None
        # Sequence parallel (--gpus N): every rank's device, rank 0 first, and the group the video decode is
        # shared over. One process: [device] and None.
        self.devices: list[str] = [self.options.device]
        self.pipeline = Pipeline(self.components, offload_text_encoder=offload_text_encoder,
                                 release_adaln=release_adaln)
        self.pipeline.memory_check = self._check_rows

    @classmethod
    def of(cls, **components) -> "Engine":
        """An engine over components already in memory (a ComfyUI node's, a test's); nothing is loaded."""
        device = str(components.pop("device", "cpu"))
        return cls(options=LoadOptions(device=device, kernels=None), components=Components(device=device,
                                                                                              **components))

    # ------------------------------------------------------------------ what it holds
    @property
    def device(self) -> str:
        return self.options.device

    @property
    def settings(self):
        return self.options.kernels

    @property
    def decode_group(self):
        return self.pipeline.decode_group

    @decode_group.setter
    def decode_group(self, group) -> None:
        self.pipeline.decode_group = group

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def modes(self) -> list[str]:
        c = self.components
        return (["t2va", "fl2va"] if c.dit is not None else []) + (["ref2va"] if c.dit_ref is not None else [])

    def dit_keys(self) -> list[str]:
        return [k for k in ("dit", "dit_ref") if getattr(self.components, k) is not None]

    # ------------------------------------------------------------------ loading
    def plan(self, modes: Sequence[str] | None = None, *, dit_only: bool = False,
             audio: bool = True) -> dict[str, object]:
        """What `load` will build: component name -> its path (or the override that builds it).

        `modes` given: the DiT partitions those modes need, each required. None (the service): every DiT
        partition the paths give, at least one. The text encoder and both VAEs are required unless `dit_only`
        (the bench's DiT forwards, trace tools): then only the DiTs are planned. `audio` False (stills: text to
        image decodes no soundtrack): the audio VAE is neither required nor planned, even where the paths give it.
        """
        self.paths.check_models()
        found = {name: (self.overrides[name] if name in self.overrides else self.paths.resolve(name))
                 for name in LOADED}
        if modes is None:
            dits = [k for k in ("dit", "dit_ref") if found[k] is not None]
            if not dits:
                raise InputError("no DiT to serve: pass --models (a download with FL2VA/ and/or Ref2VA/, or the "
                                 "older transformer/ and/or transformer_ref/), --dit or --dit-ref")
        else:
            bad = [m for m in modes if m not in MODE_PARTITIONS]
            if bad:
                raise InputError(f"unknown mode(s) {bad}; choose from {', '.join(MODE_PARTITIONS)}")
            dits = []
            for partition in sorted({MODE_PARTITIONS[m] for m in modes}):
                key = "dit" if partition == "t2va" else "dit_ref"
                if found[key] is None:
                    wanted = "/".join(m for m in modes if MODE_PARTITIONS[m] == partition)
                    raise InputError(f"{wanted} needs the {self.paths.folder_hint(key)} DiT: pass --models or "
                                     f"--{key.replace('_', '-')}")
                dits.append(key)
        if dit_only:
            return {name: found[name] for name in dits}
        needed = ("text_encoder", "vae") + (("audio_vae",) if audio else ())
        for name in needed:
            if found[name] is None:
                raise InputError(f"the {name.replace('_', ' ')} is needed: pass --models or "
                                 f"--{name.replace('_', '-')}")
        return {name: found[name] for name in LOADED if name in dits or name in needed}

    def preflight(self, plan: Mapping[str, object]) -> None:
        """Fail before reading any weights when the device or the asked-for kernels cannot run here, or when a
        planned component's files and configs are wrong or do not fit the others (file_checks.py)."""
        from ..checkpoint.stored import linear_format_of
        from .file_checks import check_files

        check_device(self.device)
        checked = check_files(plan, self.options, self.tokenizer_path(), set(self.overrides))
        for key, (_, formats) in checked.dits.items():
            self.checkpoint_formats[key] = linear_format_of(formats)
            shifts = self.paths.sigma_shifts(key)
            if shifts is not None:
                self.components.shifts[key] = shifts
        if self.settings is None:
            return
        from ...kernels.attention import resolve_attention
        from ...kernels.dispatch import resolve_linear

        for fmt in self.checkpoint_formats.values() or ["bf16"]:
            resolve_linear(self.settings, self.device, fmt)
        resolve_attention(self.settings.attention, self.device, self.settings)
        if self.settings.nvfp4_static_scales:
            from .static_scales import check_for_engine

            key, art = check_for_engine(
                self.settings.nvfp4_static_scales, {k: plan[k] for k in ("dit", "dit_ref") if plan.get(k) is not None},
                self.model_ids, lambda k: resolve_linear(self.settings, self.device,
                                                         self.checkpoint_formats.get(k, "bf16")),
                "H3_NVFP4_STATIC_SCALES")
            self.static_artifacts = {key: art}

    def tokenizer_path(self):
        """The tokenizer folder the text encoder reads (None: the text encoder's own, or an override builds it)."""
        return None if "text_encoder" in self.overrides else self.paths.resolve("tokenizer")

    def load(self, modes: Sequence[str] | None = None, on_progress: ProgressFn | None = None, *,
             dit_only: bool = False, audio: bool = True) -> "Engine":
        """Load what `plan(modes, dit_only=..., audio=...)` names, once, in order, reporting each component to
        `on_progress`."""
        report = on_progress or (lambda event: None)
        plan = self.plan(modes, dit_only=dit_only, audio=audio)
        self.preflight(plan)
        choose_allocator(self.options.device)  # before the first weight lands on the GPU
        self._resolve_auto_budget(plan)
        tokenizer = self.tokenizer_path()
        for name, source in plan.items():
            build = source if name in self.overrides else component_loader(name, source, self.options, tokenizer)
            report(LoadEvent(name, "loading"))
            start = time.perf_counter()
            try:
                model = build()
                self._configure(name, model)
            except H3Error as exc:
                report(LoadEvent(name, "failed", error=str(exc)))
                raise
            except Exception as exc:
                report(LoadEvent(name, "failed", error=f"{type(exc).__name__}: {exc}"))
                raise
            setattr(self.components, name, model)
            # Build and configure; merging LoRAs is reported on its own line (`<name>_loras`).
            seconds = time.perf_counter() - start - self.load_seconds.get(f"{name}_loras", 0.0)
            self.load_seconds[name] = round(seconds, 3)
            report(LoadEvent(name, "resident", self.load_seconds[name]))
        check_fit(self.components)  # components given one by one must belong together: fail now, not mid-job
        if self.options.vram_budget is not None:
            # Its own line: from a cold file this is where the DiT's blocks are read (packed, pinned, uploaded).
            start = time.perf_counter()
            self._place_all()
            self.load_seconds["placement"] = round(time.perf_counter() - start, 3)
        return self

    def _configure(self, name: str, model) -> None:
        """LoRAs and kernels for a DiT, the decode batch and kernels for the video VAE: once, at load."""
        if name in ("dit", "dit_ref"):
            if self.options.loras:
                from ..checkpoint.lora import apply_loras

                start = time.perf_counter()
                apply_loras(model, self.options.loras)
                self.load_seconds[f"{name}_loras"] = round(time.perf_counter() - start, 3)
            if self.settings is not None:
                from .kernel_plan import apply_kernels
                from .memory import configure_in_host

                # A DiT read into host memory (a budget, or low-bit linears to make) is configured block by block
                # on the device; without a budget each converted block then stays there.
                keep = self.options.vram_budget is None
                self.kernel_reports[name] = (configure_in_host(model, self.settings, self.device, keep)
                                             if self.options.loads_via_host else apply_kernels(model, self.settings))
                self.default_attention[name] = (model.attention, model.qk_prep)
                self._install_static_scales(name, model)

        elif name == "vae":
            model.tile_batch = self.options.vae_tile_batch
            if self.settings is not None:
                from .kernel_plan import apply_vae_kernels

                self.kernel_reports[name] = apply_vae_kernels(model, self.settings)

    def _install_static_scales(self, name: str, model) -> None:
        """The checked artifact's scales on DiT `name` (its layers must be the calibrated ones); the other DiT
        keeps dynamic scales, and both reports say which."""
        from ...kernels.nvfp4_static import layer_shapes
        from .static_scales import StaticScales, check_layers

        linear = self.kernel_reports[name]["linear"]
        art = self.static_artifacts.get(name)
        if art is None:
            if self.static_artifacts:
                linear["static_scales"] = {"note": "dynamic: the static-scales artifact is for the other partition"}
            return
        source = "H3_NVFP4_STATIC_SCALES"
        check_layers(art, layer_shapes(model), source)
        model.nvfp4_static_scales = StaticScales(model, art, source, self.device)
        linear["static_scales"] = model.nvfp4_static_scales.describe()

    def _resolve_auto_budget(self, plan) -> None:
        """`--vram-budget auto` (the front doors' default on a GPU): resident when the files say everything fits
        the free memory, else a budget of that memory; what it chose goes into `auto_budget` for the reports."""
        from .memory import AUTO, auto_budget, planned_bytes

        if self.options.vram_budget != AUTO:
            return
        if torch.device(self.device).type != "cuda":
            self.options.vram_budget = None
            return
        try:
            need, why = planned_bytes(plan, self.options), None
        except (OSError, ValueError, KeyError) as exc:  # the loaders will say what is wrong with the files
            need, why = None, f"the files could not be sized ({type(exc).__name__}: {exc})"
        free = torch.cuda.mem_get_info(torch.device(self.device))[0]
        self.options.vram_budget = auto_budget(need, free)
        self.auto_budget = {"chose": "resident" if self.options.vram_budget is None else "streaming",
                            "planned_bytes": need, "free_bytes": free, "budget_bytes": self.options.vram_budget}
        if why is not None:
            self.auto_budget["note"] = why

    def _place_all(self) -> None:
        """Under the budget, after loading: each DiT gets what the largest other stage leaves, with the text encoder
        streaming its layers (visiting for its stage) and the VAEs waiting in host memory between theirs; when every
        DiT is then resident whole, the room left keeps the VAEs and the text encoder (or its layers) on the GPU."""
        from .memory import check_host, gb, text_stage_bytes, vae_stage_bytes

        c = self.components
        depth = self.options.prefetch_depth
        te = c.text_encoder if hasattr(c.text_encoder, "model") else None
        vaes = [m for m in (c.vae, c.audio_vae) if m is not None]
        reserve = {}
        if te is not None:
            reserve["text_encode"] = text_stage_bytes(te, depth)
        if vaes:  # a DiT loaded alone keeps nothing for other stages
            reserve["vae"] = vae_stage_bytes(c.vae, c.audio_vae)
        self.stage_reserve = reserve
        kept = max(reserve.values(), default=0)
        share = (f" left to the DiT (of {gb(self.options.vram_budget)}, where the text encoder's and the VAEs' "
                 f"stages need {gb(kept)} beside its weights, in turn with its activations)") if reserve else ""
        if self.controlnet_reserve:
            share += f" less the {gb(self.controlnet_reserve)} the ControlNet's tower needs with its blocks streamed"
        plans: dict[str, object] = {}
        for key in self.dit_keys():
            plans[key] = self._plan(getattr(c, key), self.options.vram_budget, plans.values(), share, kept)

        self.kept_on_device = self._spare_room(plans, te, vaes, reserve)
        self._place_others(te, vaes)
        # Checked before any block is packed into host memory: nothing starts half-placed.
        self.host_plan = check_host(self.options.host_budget, plans.values(), te, self.pipeline.visit.parked)
        from .placement import place_dit

        for key, plan in plans.items():
            place_dit(getattr(c, key), plan, self.device)
            self.memory_plans[key] = plan
        if te is not None and te.layer_stream is not None:
            self._pin_text_layers(te)
        if torch.device(self.device).type == "cuda":
            torch.cuda.empty_cache()

    def _pin_text_layers(self, te) -> None:
        """The streamed text layers into page-locked host memory when the host has room (memory.text_pinning):
        decided after the DiTs are placed, when their host copies are gone; the host plan reports it."""
        from .host_memory import available_bytes
        from .memory import stream_text_encoder, text_pinning

        pinning = text_pinning(te, self.options.text_pin, self.host_plan["held_bytes"], self.options.host_budget,
                               available_bytes())
        self.host_plan["text_layers"] = pinning.describe()
        if pinning.pinned:
            te.layer_stream.restore()  # the layers' own tensors again, then packed
            stream_text_encoder(te, self.device, self.options.prefetch_depth, te.kept_layers, pin=True)
            self._count_pinned_text(te)
            # The rest of the encoder (counted as held already) stays on the host for good, page-locked too.
            held = te.hold_outside_on_host(pin=torch.device(self.device).type == "cuda")
            self.host_plan["text_layers"]["outside_layers_held_bytes"] = held
        else:
            self._read_text_ahead(te, pinning.available_bytes)

    def _read_text_ahead(self, te, available: int | None) -> None:
        """Layers streamed from the file's pages are read by a page reader's threads, as many layers ahead of their
        copies as the host's available memory holds in page cache (memory.read_ahead_window), starting now: a cold
        file is read while the engine waits for its first request. The host plan reports it."""
        from ..dit.page_reader import PageReader
        from .memory import read_ahead_window

        threads, plan = self.options.read_threads, self.host_plan["text_layers"]
        if threads == 0:
            plan["read_ahead"] = {"threads": 0, "why": "H3_READ_THREADS=0: the kernel reads the next layer ahead "
                                                       "(madvise)"}
            return
        window, why = read_ahead_window(te.layer_stream, available)
        refused = te.layer_stream.attach_reader(PageReader(threads), window)
        plan["read_ahead"] = {"threads": 0 if refused else threads, "window_layers": 0 if refused else window,
                              "why": refused or why}
        te.layer_stream.prime()

    def text_read_ahead(self) -> dict | None:
        """The text layers' page reader as it stands: its plan (threads, window) and its progress (layers read and
        being read, bytes); None without a reader."""
        te = self.components.text_encoder
        stream = getattr(te, "layer_stream", None)
        if stream is None or stream.reader is None:
            return None
        return {**self.host_plan["text_layers"]["read_ahead"], **stream.read_progress()}

    def wait_text_read_ahead(self) -> dict | None:
        """Until the page reader has read what it was given (after a load: its primed window), for a caller whose
        first request is not due yet, as a service idles after its load; the report with the seconds waited. None
        without a reader."""
        if self.text_read_ahead() is None:
            return None
        start = time.perf_counter()
        self.components.text_encoder.layer_stream.wait_reads()
        return {**self.text_read_ahead(), "waited_s": round(time.perf_counter() - start, 3)}

    def _count_pinned_text(self, te) -> None:
        """The host plan's count of the text layers' page-locked buffers, as they are now."""
        from .memory import pinned_text_bytes

        now = pinned_text_bytes(te)
        self.host_plan["held_bytes"] += now - self.host_plan["text_layers_pinned_bytes"]
        self.host_plan["text_layers_pinned_bytes"] = now

    def _spare_room(self, plans: dict, te, vaes: list, reserve: dict):
        """What stays on the GPU beside DiTs resident whole (memory.keep_on_device). Nothing when a DiT streams:
        its blocks are copied at every evaluation, the others' weights once a stage, so it takes the whole budget;
        nor beside a ControlNet tower to come (its blocks run in every evaluation of its window)."""
        from .memory import KeptOnDevice, keep_on_device, slack, tensor_bytes, text_sizes, vae_stage_bytes

        if any(p.streaming for p in plans.values()):
            return KeptOnDevice(why="nothing: a DiT streams and takes the whole budget")
        if self.controlnet_reserve:
            return KeptOnDevice(why="nothing: the ControlNet tower takes the room beside the DiTs")
        budget, depth, c = self.options.vram_budget, self.options.prefetch_depth, self.components
        # A second slack beside the plan's: kept weights live through every stage, so the stages' temporaries
        # fragment around them (an H100 run that kept 20.8 GB ran out in a long window's VSA with 5 GB reserved
        # but unallocated).
        room = (budget - 2 * slack(budget) - sum(p.device_bytes - p.activations for p in plans.values()))
        text = None if te is None else text_sizes(te, depth)
        vae_stage = (reserve.get("vae", 0), vae_stage_bytes(c.vae, c.audio_vae, kept=True) if vaes else 0)
        activations = max((p.activations for p in plans.values()), default=0)
        return keep_on_device(room, activations, sum(tensor_bytes(m) for m in vaes), vae_stage, text)

    def _place_others(self, te, vaes: list) -> None:
        """The VAEs and the text encoder as `kept_on_device` says: kept ones on the GPU, the VAEs otherwise parked
        in host memory (visiting their stages), the text encoder's other layers streamed."""
        from .memory import Visits, stream_text_encoder

        keep = self.kept_on_device
        visits = Visits(self.device)
        for module in vaes:
            if keep.vaes:
                module.to(self.device)
            else:
                visits.park(module)
        self.pipeline.visit = visits
        if te is None:
            return
        if keep.text_whole:
            te.device = torch.device(self.device)
            te.mark_offloaded()
            te.ensure_resident()
        else:
            stream_text_encoder(te, self.device, self.options.prefetch_depth, keep.text_layers)
            self.pipeline.offload_text_encoder = True

    def _plan(self, model, budget: int, taken_by, share: str = "", kept: int = 0):
        """The blocks that fit stay on the device, the others stream. Two DiTs share the budget (only one runs
        at a time, so their activations do not add up), and the other stages' `kept` bytes take turns with the
        DiT's activations (memory.dit_budget)."""
        from .memory import activation_bytes, default_rows, dit_budget, plan_dit

        taken = sum(p.device_bytes - p.activations for p in taken_by) + self.controlnet_reserve
        rows = self.options.plan_rows or default_rows(model.config)
        room = dit_budget(budget - taken, kept, activation_bytes(model.config, rows, model.dtype_))
        return plan_dit(model, room, rows, depth=self.options.prefetch_depth, share=share)

    def _check_rows(self, dit, rows: int, mlp_chunks: int = 1) -> None:
        """Before sampling: a request longer than the budget was planned for must still fit; the spare room is
        given back first if its activations need it."""
        from .memory import activation_bytes, check_rows

        for key, plan in self.memory_plans.items():
            if getattr(self.components, key) is dit:
                check_rows(plan, dit.config, rows, dit.dtype_, mlp_chunks)
        keep = self.kept_on_device
        if keep is not None and keep.kept_bytes:
            need = activation_bytes(dit.config, rows, dit.dtype_, mlp_chunks)
            if keep.kept_bytes + need > keep.room_bytes:
                self._give_back_kept(f"a request of {rows} rows needs the room for its activations", need)

    def _give_back_kept(self, why: str, need: int) -> None:
        """Room for `need` bytes of activations beside what stays kept: the text encoder's layers go back to
        streaming first (used once a prompt), then, if still short, the VAEs wait in host memory between their
        stages (used every render). For the engine's life: a long request came once and may come again."""
        from .memory import KeptOnDevice, stream_text_encoder

        c, keep = self.components, self.kept_on_device
        kept_bytes, vaes = keep.kept_bytes, keep.vaes
        if keep.text_whole or keep.text_layers:
            te = c.text_encoder
            pinned = te.layer_stream is not None and not te.layer_stream.in_place
            if te.layer_stream is not None:
                te.layer_stream.restore()  # the streamed layers' tensors are their host copies again
            te.kept_layers = 0
            # Pinned layers stay pinned (their buffers are reused; the ones kept until now are packed beside them:
            # text_pinning counted every layer); an encoder kept whole until now is weighed for pinning now.
            stream_text_encoder(te, self.device, self.options.prefetch_depth, pin=pinned)
            if pinned:
                self._count_pinned_text(te)
            elif self.host_plan is not None and "text_layers" not in self.host_plan:
                self._pin_text_layers(te)
            elif self.host_plan is not None:  # in place as before: the new stream reads ahead as the old one did
                from .host_memory import available_bytes

                self._read_text_ahead(te, available_bytes())
            self.pipeline.offload_text_encoder = True
            kept_bytes -= keep.text_bytes
        if vaes and kept_bytes + need > keep.room_bytes:
            for module in (c.vae, c.audio_vae):
                if module is not None:
                    self.pipeline.visit.park(module)
            kept_bytes, vaes = 0, False
        self.kept_on_device = KeptOnDevice(vaes=vaes, kept_bytes=kept_bytes, peak_bytes=keep.peak_bytes,
                                           room_bytes=keep.room_bytes, why=f"given back: {why}")
        if torch.device(self.device).type == "cuda":
            torch.cuda.empty_cache()

    def memory_report(self, key: str) -> dict | None:
        """The budget's plan for one DiT (or the ControlNet tower, "controlnet") and what its stream copied so far
        (None without a budget)."""
        if key == "controlnet":
            return self._tower_report()
        plan = self.memory_plans.get(key)
        if plan is None:
            return None
        out = {**plan.describe(), "reserved_for_other_stages": dict(self.stage_reserve), "host": self.host_plan}
        ahead = self.text_read_ahead()
        if ahead is not None:  # live: /ready shows how far a cold file's text layers are read
            out["host"] = {**self.host_plan, "text_layers": {**self.host_plan["text_layers"], "read_ahead": ahead}}
        te = self.components.text_encoder
        layers = len(te.model.language_model.layers) if hasattr(te, "model") else None
        out["kept_on_device"] = self.kept_on_device.describe(layers)
        stream = getattr(getattr(self.components, key), "block_stream", None)
        if stream is not None:
            out.update(forwards=stream.stats.forwards, bytes_copied=stream.stats.bytes_copied,
                       bytes_copied_per_forward=stream.stats.bytes_copied // max(1, stream.stats.forwards),
                       adaln_bytes_copied=stream.stats.adaln_bytes_copied)
        return out

    def _tower_report(self) -> dict | None:
        plan, tower = self.controlnet_plan, self.components.controlnet
        if plan is None or tower is None:
            return None
        out = plan.describe()
        # The tower's plan was fitted to the room the DiTs' plans left (the budget's slack is the DiTs').
        out["room_bytes"] = out.pop("budget_bytes")
        out.pop("slack_bytes")
        stream = tower.block_stream
        if stream is not None:
            out.update(bytes_copied=stream.stats.bytes_copied, adaln_bytes_copied=stream.stats.adaln_bytes_copied)
        return out

    def distribute(self, devices: list[str] | None, group) -> None:
        """Sequence parallel: split every DiT's forwards over all ranks, and share the decode over `group`;
        `devices` (every rank's, rank 0 first) is what reports list."""
        from ..dit.parallel import split_over_ranks

        for key in self.dit_keys():
            split_over_ranks(getattr(self.components, key))
        if devices is not None:
            self.devices = list(devices)
        self.decode_group = group

    # ------------------------------------------------------------------ one job's attention
    def choose_attention(self, key: str, name: str | None) -> AttentionChoice | None:
        """DiT `key`'s attention `name` for one job, resolved once for its heads (KernelUnavailable when it cannot
        run them); None for the attention it was loaded with."""
        if name is None:
            return None
        return choose_attention(getattr(self.components, key), name, self.settings, self.device)

    @contextlib.contextmanager
    def job_attention(self, key: str, choice: AttentionChoice | str | None) -> Iterator[dict]:
        """Run one job on DiT `key` with `choice` (made by `choose_attention`, or a name resolved here; None: the
        load-time attention), the load-time one back after; yields the job report's "attention" and "qk_prep"."""
        if isinstance(choice, str):
            choice = self.choose_attention(key, choice)
        if choice is None:
            base = self.kernel_reports[key]
            yield {"attention": base["attention"], "qk_prep": base["qk_prep"]}
            return
        with running(getattr(self.components, key), choice, self.default_attention[key]):
            yield choice.report

    # ------------------------------------------------------------------ the pipeline's stages
    def generate(self, req: GenerationRequest, *, on_progress=None, cancel=None, on_frames=None) -> GenerationResult:
        return self.pipeline.generate(req, on_progress=on_progress, cancel=cancel, on_frames=on_frames)

    def encode_text(self, mode: str, prompt: str, keyframes=(), references=(), unnamed: str = "refuse"):
        return self.pipeline.encode_text(mode, prompt, keyframes, references, unnamed)

    def encode_keyframe(self, frame: torch.Tensor, tile_size: int | None = DEFAULT_ENCODE_TILE) -> torch.Tensor:
        """A keyframe's normalised conditioning latents (1, C, 1, h, w), cached by content."""
        return self.pipeline.encode_keyframe(frame, tile_size)[0]

    def encode_reference(self, reference, tile_size: int | None = DEFAULT_ENCODE_TILE):
        """A prepared reference's video and / or audio latents (`EncodedReference`), cached by content."""
        return self.pipeline.encode_reference(reference, tile_size)[0]

    def sample(self, dit, request, schedule, seed: int, **kwargs):
        return self.pipeline.sample(dit, request, schedule, seed, **kwargs)

    def load_taeh3(self, path) -> None:
        """Load TAEH3 from `path` (madebyollin/taehv's taeh3.safetensors, checked to be the temporal decoder) for
        the requests that choose decoder "taeh3" (drafts: its frames, not the VAE's; the audio VAE as before) and
        for decoded previews; None drops it. The video VAE stays every other request's decoder."""
        if path is None:
            self.pipeline.taeh3 = None
            return
        from ..vae.tiny_decoder import load_tiny_decoder

        self.pipeline.taeh3 = load_tiny_decoder(path, device=self.options.device, dtype=self.options.vae_dtype)

    def check_controlnet(self, path, modes: Sequence[str] | None = None) -> None:
        """An H3 Fun ControlNet file against the DiTs `load(modes)` would build, from the headers alone: one line
        when it is no ControlNet or is for another width, AdaLN form or depth."""
        from ..checkpoint import open_dit
        from ..checkpoint.controlnet import ControlNetFile

        with ControlNetFile(path) as f:
            f.check()
            # Under a VRAM budget the DiT's plan leaves the tower the least it runs in (its blocks streamed); the
            # tower keeps resident what the DiT's plan leaves beyond that (load_controlnet).
            self.controlnet_reserve = f.streamed_bytes(self.options.dtype, self.options.prefetch_depth)
            for key, source in self.plan(modes, dit_only=True).items():
                if key in self.overrides:
                    continue  # built in memory: checked when the tower loads
                reader = open_dit(source)
                try:
                    f.config.check_fits(reader.config, str(f.path))
                finally:
                    reader.source.close()

    def load_controlnet(self, path) -> None:
        """Load an H3 Fun ControlNet's tower for the requests that bring a control (checked against every loaded DiT
        first): on the DiT's device in its dtype, a quantized file's layers kept as stored and dequantized at use.
        Under a VRAM budget it is read into host memory and placed by its own plan (memory.plan_tower): resident
        in what the DiTs' plans leave, else its blocks stream like the DiT's; `check_controlnet` before `load`
        makes the DiT's plan leave it at least its streamed minimum. None drops it."""
        if path is None:
            self.components.controlnet, self.controlnet_plan = None, None
            return
        from ..checkpoint.controlnet import ControlNetFile, load_tower

        dits = [getattr(self.components, k) for k in self.dit_keys()]
        if not dits:
            raise H3Error("a ControlNet runs beside a DiT: load the DiT first")
        with ControlNetFile(path) as f:
            for dit in dits:
                f.check(dit.config)
        start = time.perf_counter()
        budget = self.options.vram_budget if self.memory_plans else None
        if budget is None:
            self.components.controlnet = load_tower(path, dits[0].config, dtype=self.options.dtype,
                                                    device=self.device)
            self.controlnet_plan = None
        else:
            from .memory import check_host, plan_tower, tower_room
            from .placement import place_tower

            tower = load_tower(path, dits[0].config, dtype=self.options.dtype, device="cpu")
            keep = self.kept_on_device
            if keep is not None and keep.kept_bytes:
                # The tower's blocks run in every evaluation of its window: it takes the spare room.
                self._give_back_kept("a ControlNet tower takes the room beside the DiTs", keep.room_bytes + 1)
            room = tower_room(budget, self.memory_plans.values(), max(self.stage_reserve.values(), default=0))
            plan = plan_tower(tower, room, depth=self.options.prefetch_depth)  # refused before anything moves
            parked = getattr(self.pipeline.visit, "parked", [])  # the VAEs _place_all parked
            pinning = (self.host_plan or {}).get("text_layers")
            self.host_plan = check_host(self.options.host_budget, self.memory_plans.values(),
                                        self.components.text_encoder, parked, tower=plan)
            if pinning is not None:
                self.host_plan["text_layers"] = pinning
            place_tower(tower, plan, self.device)
            self.components.controlnet, self.controlnet_plan = tower, plan
        self.load_seconds["controlnet"] = round(time.perf_counter() - start, 3)

    @property
    def taeh3(self):
        """The loaded TAEH3 decoder (its file in `.source`), or None."""
        return self.pipeline.taeh3

    def decode_video(self, latents: torch.Tensor, tile_size: int | None = 256, on_frames=None,
                     decoder: str = "vae") -> torch.Tensor:
        return self.pipeline.decode_video(latents, tile_size, on_frames, decoder)

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipeline.decode_audio(latents)

    @staticmethod
    def mux(path, video: torch.Tensor, audio: torch.Tensor | None, *, fps: int, crf: int | None = None) -> None:
        """Frames (F, H, W, 3) uint8 and stereo 32 kHz audio -> an mp4 with AAC sound."""
        from ..media.files import write_mp4

        kwargs = {} if crf is None else {"crf": int(crf)}
        write_mp4(path, video, audio, fps=int(fps), **kwargs)

    def clear_caches(self) -> None:
        self.pipeline.clear_caches()
