"""Kiln's trainer: build everything from a JobConfig, run the loop, report, exit cleanly.

    torchrun --nproc-per-node=2 train.py --config llama_debug.toml
    python train.py --config llama_debug.toml --training.steps 20
"""

import contextlib
import importlib
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from components.checkpoint import CheckpointManager, check_model_matches
from components.checkpoint_states import (
    DataLoaderState,
    ModelState,
    OptimizerState,
    SchedulerState,
    StreamingLoaderState,
    TrainState,
)
from components.config import JobConfig, config_to_toml, load_config, resolve_path
from components.data import (
    BatchLoader,
    TokenWindows,
    resolve_dataset,
    token_file_for,
    validation_batches,
)
from components.distributed import DistInfo, exit_cleanly, init_distributed, lost_peer_message, set_seed
from components.errors import KilnError
from components.gc_control import GarbageCollection
from components.grad_norm import clip_grad_norm
from components.loss import IGNORE_INDEX, cross_entropy_sum
from components.metrics import MetricsLogger
from components.moe_load import (
    balance_experts,
    imbalance,
    moe_layers,
    reset_expert_load,
    set_aux_loss_scale,
)
from components.optim import build_lr_scheduler, build_optimizer
from components.peak_flops import peak_flops
from components.preemption import StopRequest
from components.profiling import maybe_profile
from components.streaming_loader import StreamingLoader
from components.tokenizer import Tokenizer
from models import UnknownModelError, get_model_args, get_model_spec
from parallelisms.context_parallel import head_tail_positions, shard_sequence
from parallelisms.fsdp import set_gradient_sync
from parallelisms.materialize import materialize_and_init
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline import PipelineRunner, build_stages, parse_stage_layers, split_layers, stage_ids
from parallelisms.tensor_parallel import local_value, loss_context


class Trainer:
    """One training run: model, data, optimizer and metrics built from the config, then the loop."""

    def __init__(self, cfg: JobConfig, info: DistInfo) -> None:
        self.cfg, self.info = cfg, info
        t = cfg.training
        set_seed(t.seed, t.deterministic)
        self.dump = Path(cfg.job.dump_folder)

        # Model family and shape.
        if cfg.job.custom_import:
            sys.path.insert(0, os.getcwd())
            try:
                importlib.import_module(cfg.job.custom_import)
            except ImportError as e:
                raise KilnError(
                    f"job.custom_import {cfg.job.custom_import!r} cannot be imported: {e}") from None
        try:
            self.spec = get_model_spec(cfg.model.name)
            self.model_args = get_model_args(self.spec, cfg.model.flavor)
        except UnknownModelError as e:
            raise KilnError(str(e)) from None
        args = self.model_args
        self.tokenizer = Tokenizer(resolve_path(cfg.model.tokenizer_path))
        if self.tokenizer.vocab_size > args.vocab_size:
            raise KilnError(
                f"tokenizer {cfg.model.tokenizer_path} has {self.tokenizer.vocab_size} tokens but "
                f"model {cfg.model.name}/{cfg.model.flavor} has a vocabulary of {args.vocab_size}"
            )
        if t.seq_len > args.max_seq_len:
            raise KilnError(
                f"training.seq_len {t.seq_len} exceeds the model's max_seq_len {args.max_seq_len}")

        # Layout: the degrees, checked against the world and the model, then one mesh.
        p = cfg.parallelism
        self.dims = ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree, world_size=info.world_size,
        )
        self.dims.check_model(n_heads=args.n_heads, n_kv_heads=args.kv_heads, n_layers=args.n_layers,
                              seq_len=t.seq_len, vocab_size=args.vocab_size)
        self.dims.build_mesh(info.device.type)
        dp_mesh = self.dims.mesh("dp")
        self.dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
        # Ranks that hold different tokens of a step (data and context parallel): losses and token
        # counts are summed over them.
        loss_mesh = self.dims.mesh("dp_cp")
        self.loss_group = loss_mesh.get_group() if loss_mesh is not None else None
        # Under context parallel each rank keeps its head-tail share of every sequence.
        cp_mesh = self.dims.mesh("cp")
        self.cp_positions = (head_tail_positions(t.seq_len, self.dims.cp, cp_mesh.get_local_rank())
                             if cp_mesh is not None else None)
        dp = self.dims.dp
        self.global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp

        # Data: tokenized once into the cache, then read as windows; the batch depends on the step only.
        self.streaming = t.dataset_mode == "streaming"
        if self.streaming:  # the train split is read on the fly; validation still from token files
            splits = resolve_dataset(t.dataset, t.dataset_path)
            self.splits = {k: v for k, v in splits.items() if k == "val"}
        else:
            self.splits = resolve_dataset(t.dataset, t.dataset_path)
        if cfg.validation.dataset:
            try:
                val = resolve_dataset(cfg.validation.dataset, "")
            except KilnError as e:
                raise KilnError(f"validation.dataset: {e}") from None
            self.splits["val"] = val.get("val", val["train"])
        cache = Path(t.data_cache_dir) if t.data_cache_dir else self.dump / "data_cache"
        self.token_files = self._prepare_token_files(cache)
        if self.streaming:
            source = str(resolve_dataset(t.dataset, t.dataset_path)["train"])
            self.train_windows = None
            self.loader = StreamingLoader(source, t.dataset_text_field, self.tokenizer, t.seq_len,
                                          self.global_batch, t.local_batch_size, self.dp_rank, dp,
                                          cache_dir=str(cache / "hf"))
        else:
            self.train_windows = TokenWindows(self.token_files["train"], t.seq_len, args.vocab_size)
            self.loader = BatchLoader(self.train_windows, self.global_batch, t.local_batch_size,
                                      self.dp_rank, dp, t.seed)
        self.val_batches = self._validation_batches()

        # Model: built on the meta device, split into pipeline stages, parallelized, materialised.
        with torch.device("meta"):
            whole = self.spec.model_cls(args)
        self.num_params = sum(p.numel() for p in whole.parameters())
        self.flops_per_token = self.spec.flops_per_token_fn(args, self.num_params, t.seq_len)
        mp = t.mixed_precision_param
        self.param_dtype = mp if mp != "auto" else ("bfloat16" if info.device.type == "cuda" else "float32")
        self.model_parts, self.stage_ids, self.num_stages = self._split(whole)
        self._check_document_mask()
        for part in self.model_parts:
            self.spec.parallelize_fn(part, self.dims, cfg, self.param_dtype)
            materialize_and_init(part, lambda: self.spec.model_cls(args), t.seed, info.device)
            part.train()
            if t.document_mask:
                part.document_bos_id = self.tokenizer.bos_id
                part.restart_positions = t.document_positions_restart
        # Without FSDP (which casts parameters itself), bf16 compute comes from autocast.
        self.autocast = (
            torch.autocast(info.device.type, dtype=torch.bfloat16)
            if self.param_dtype == "bfloat16" and not self.dims.fsdp_enabled
            else contextlib.nullcontext()
        )

        # Under TP the logits stay sharded over the vocabulary into the loss, unless disabled.
        self.use_loss_parallel = self.dims.tp > 1 and not cfg.parallelism.disable_loss_parallel
        # The loss is compiled with the blocks, except on vocabulary-sharded DTensor logits.
        self.loss_fn = (torch.compile(cross_entropy_sum) if cfg.compile.enable and not self.use_loss_parallel
                        else cross_entropy_sum)

        # MoE layers (if any): their expert load moves the expert bias after each step.
        self.moe_layers = moe_layers(self.model_parts)
        self.expert_load: dict[str, list[int]] = {}
        self.pipeline = self._pipeline() if self.dims.pp > 1 else None

        # One optimizer and LR schedule per model part (pipeline stages keep separate state dicts).
        o, s = cfg.optimizer, cfg.lr_scheduler
        self.optimizers = [build_optimizer(part, o.name, o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay,
                                           o.implementation) for part in self.model_parts]
        self.schedulers = [build_lr_scheduler(
            opt, warmup_steps=s.warmup_steps, total_steps=t.steps, decay_ratio=s.decay_ratio,
            decay_type=s.decay_type, min_lr_factor=s.min_lr_factor) for opt in self.optimizers]
        self.state = TrainState()
        c = cfg.checkpoint
        self.checkpoint = CheckpointManager(
            self.dump / c.folder,
            {"model": ModelState(self.model_parts),
             "optimizer": OptimizerState(self.model_parts, self.optimizers),
             "lr_scheduler": SchedulerState(self.schedulers),
             "dataloader": (StreamingLoaderState if self.streaming else DataLoaderState)(self.loader),
             "train_state": self.state},
            enable=c.enable or c.create_seed_checkpoint, interval=c.interval,
            keep_latest_k=c.keep_latest_k, load_step=c.load_step, async_mode=c.async_mode,
            last_save_model_only=c.last_save_model_only, export_dtype=c.export_dtype,
            exclude_from_loading=c.exclude_from_loading, is_main=info.is_main,
            partial_model=self.dims.pp > 1, shared_folder_wait_seconds=c.shared_folder_wait_seconds)
        # One process per node measures the CPU peak while the others wait, then they read its cache.
        if info.local_rank == 0:
            self.peak = peak_flops(info.device, cfg.metrics.peak_tflops)
        if dist.is_initialized():
            dist.barrier()
        if info.local_rank != 0:
            self.peak = peak_flops(info.device, cfg.metrics.peak_tflops)
        tb = self.dump / cfg.metrics.save_tb_folder if cfg.metrics.enable_tensorboard else None
        self.metrics = MetricsLogger(self.dump, is_main=info.is_main, device=info.device,
                                     flops_per_token=self.flops_per_token, peak=self.peak,
                                     total_steps=t.steps, tensorboard_dir=tb)

    def _check_document_mask(self) -> None:
        """Document masking needs the tokens where attention runs: not on later pipeline stages,
        and not with context parallel's sharded sequences."""
        t = self.cfg.training
        if t.document_positions_restart and not t.document_mask:
            raise KilnError("training.document_positions_restart needs training.document_mask")
        if t.document_mask and (self.dims.pp > 1 or self.dims.cp > 1):
            raise KilnError("training.document_mask is not supported with pipeline or context parallel yet")

    def _split(self, whole: torch.nn.Module) -> tuple[list[torch.nn.Module], list[int], int]:
        """This rank's model parts: the whole model, or its pipeline stages (layers by stage)."""
        if self.dims.pp == 1:
            return [whole], [0], 1
        p = self.cfg.parallelism
        try:
            ids = stage_ids(self.dims.mesh("pp").get_local_rank(), self.dims.pp, p.pipeline_parallel_schedule)
            num_stages = self.dims.pp * len(ids)
            n_layers = self.model_args.n_layers
            layers = (parse_stage_layers(p.pipeline_parallel_stage_layers, n_layers, num_stages)
                      if p.pipeline_parallel_stage_layers
                      else split_layers(n_layers, num_stages, p.pipeline_parallel_layers_per_stage))
        except ValueError as e:
            raise KilnError(str(e)) from None
        parts = [self.spec.pipeline_fn(whole, layers[i], i == 0, i == num_stages - 1) for i in ids]
        return parts, ids, num_stages

    def _pipeline(self) -> PipelineRunner:
        """The schedule over this rank's stages; a step's rows per rank split into microbatches."""
        p = self.cfg.parallelism
        rows = self.global_batch // self.dims.dp
        size = p.pipeline_parallel_microbatch_size
        if rows % size != 0:
            raise KilnError(f"the rows per rank and step ({rows} = global_batch_size / dp) are not divisible "
                            f"by parallelism.pipeline_parallel_microbatch_size {size}")
        n_microbatches = rows // size
        if p.pipeline_parallel_schedule != "GPipe" and n_microbatches < self.dims.pp:
            raise KilnError(f"schedule {p.pipeline_parallel_schedule} needs at least as many microbatches "
                            f"as pipeline ranks ({self.dims.pp}); a step gives {n_microbatches} "
                            f"({rows} rows / microbatch size {size})")
        stages = build_stages(self.model_parts, self.stage_ids, self.num_stages, self.info.device,
                              self.dims.mesh("pp"), lambda: reset_expert_load(self.moe_layers))
        return PipelineRunner(p.pipeline_parallel_schedule, stages, n_microbatches, self.loss_fn,
                              self.num_stages)

    def _prepare_token_files(self, cache: Path) -> dict[str, Path]:
        """Local rank 0 of each node tokenizes what is missing; the others wait, then read."""
        files = {}
        field = self.cfg.training.dataset_text_field
        if self.info.local_rank == 0:
            files = {k: token_file_for(v, self.tokenizer, cache, field) for k, v in self.splits.items()}
        if dist.is_initialized():
            dist.barrier()
        if self.info.local_rank != 0:
            files = {k: token_file_for(v, self.tokenizer, cache, field) for k, v in self.splits.items()}
        return files

    def _data_line(self) -> str:
        t = self.cfg.training
        if self.streaming:
            return (f"data    {t.dataset_path or t.dataset}: streamed, tokenized on the fly, documents dealt "
                    f"to {self.dims.dp} data-parallel rank(s) (field {t.dataset_text_field!r})")
        w = self.train_windows
        return (f"data    {t.dataset_path or t.dataset}: {len(w.tokens):,} train tokens ({len(w):,} windows; "
                f"{len(w) / self.global_batch:,.1f} steps per epoch)")

    def summary(self) -> str:
        """The start-up lines: model, layout, batch, data, precision and the MFU peak."""
        d, t, a = self.dims, self.cfg.training, self.model_args
        emb = a.vocab_size * a.dim
        if d.world_size == 1:
            mode = "single process"
        elif d.hsdp_enabled:
            mode = f"HSDP: {d.dp_replicate} replicas × FSDP2 over {d.dp_shard}"
        elif d.fsdp_enabled:
            mode = f"FSDP2 over {d.dp_shard * d.cp} ranks"
        elif d.ddp_enabled:
            mode = f"DDP over {d.dp_replicate} ranks"
        else:
            mode = "no data parallelism"
        if d.cp > 1:
            cp = f"CP {d.cp} ({self.cfg.parallelism.context_parallel_rotate_method}, head-tail load balanced)"
            mode = f"{cp} × {mode}"
        if d.tp > 1:
            loss_par = "on" if self.use_loss_parallel else "off"
            tp = f"TP {d.tp} (sequence parallel, loss parallel {loss_par})"
            mode = f"{tp} × {mode}" if d.dp * d.cp > 1 else tp
        if d.pp > 1:
            p = self.cfg.parallelism
            pp = (f"PP {d.pp} ({p.pipeline_parallel_schedule}, {self.num_stages} stages, "
                  f"{self.pipeline.schedule._n_microbatches} microbatches)")
            mode = pp if mode in ("no data parallelism", "single process") else f"{pp} × {mode}"
        tokens = self.global_batch * t.seq_len
        backend = dist.get_backend() if dist.is_initialized() else "none"
        nodes = self.info.nodes
        on_nodes = f" on {nodes} nodes × {d.world_size // nodes} processes" if nodes > 1 else ""
        lines = [
            f"Kiln · {self.cfg.model.name}/{self.cfg.model.flavor} · {self.num_params / 1e6:,.2f}M "
            f"parameters ({(self.num_params - emb) / 1e6:,.2f}M non-embedding) · "
            f"{self.flops_per_token / 1e6:,.1f} MFLOP/token",
            f"layout  world {d.world_size}{on_nodes} = pp {d.pp} × dp_replicate {d.dp_replicate} × dp_shard "
            f"{d.dp_shard} × cp {d.cp} × tp {d.tp} → {mode} ({backend}, {self.info.device.type})",
            f"batch   global {self.global_batch} × seq {t.seq_len} = {tokens:,} tokens/step; "
            f"local {t.local_batch_size} × {self.loader.microbatches} microbatch(es) per rank",
            self._data_line(),
            f"numbers params {self.param_dtype}, reduce {t.mixed_precision_reduce}; AC "
            f"{self.cfg.activation_checkpoint.mode}; compile {'on' if self.cfg.compile.enable else 'off'}",
            f"MFU     peak {self.peak.tflops:,.3f} TFLOP/s per device ({self.peak.source})",
            f"output  {self.dump}/metrics.jsonl; {t.steps} steps",
        ]
        return "\n".join(lines)

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        """Forward/backward over the microbatches, clip, step.

        Returns this rank's summed loss and token count, and the global grad norm.
        """
        device = self.info.device
        # Every rank's loss is a sum over its tokens scaled by dp·cp / global tokens: the gradient
        # average over data- and context-parallel ranks (÷ dp·cp) then yields the gradient of the
        # mean over the global batch.
        microbatches = [self.shard_sequence(x, y) for x, y in microbatches]
        local_tokens = torch.tensor(sum(int((y != IGNORE_INDEX).sum()) for _, y in microbatches),
                                    dtype=torch.float64, device=device)
        global_tokens = local_tokens.clone()
        if self.loss_group is not None:
            dist.all_reduce(global_tokens, group=self.loss_group)
        scale = self.dims.dp * self.dims.cp / global_tokens.item()
        set_aux_loss_scale(self.moe_layers, scale)
        if self.pipeline is not None:
            inputs = torch.cat([x for x, _ in microbatches]).to(device)
            labels = torch.cat([y for _, y in microbatches]).to(device)
            with loss_context(self.use_loss_parallel):
                loss_sum = self.pipeline.run(inputs, labels, scale)
        else:
            loss_sum = torch.zeros((), dtype=torch.float32, device=device)
            model = self.model_parts[0]
            for i, (inputs, labels) in enumerate(microbatches):
                set_gradient_sync(model, i == len(microbatches) - 1)
                inputs, labels = inputs.to(device), labels.to(device)
                with loss_context(self.use_loss_parallel):
                    with self.autocast:
                        logits = model(inputs)
                    loss = self.loss_fn(logits, labels)
                    (loss * scale).backward()
                loss_sum += local_value(loss.detach())
        params = [p for part in self.model_parts for p in part.parameters()]
        pp_mesh = self.dims.mesh("pp")
        grad_norm = clip_grad_norm(params, self.cfg.training.max_norm,
                                   pp_mesh.get_group() if pp_mesh is not None else None)
        for opt in self.optimizers:
            opt.step()
        self.expert_load = balance_experts(self.moe_layers, self.loss_group)
        for sched in self.schedulers:
            sched.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return loss_sum, local_tokens, grad_norm

    def moe_metrics(self) -> dict:
        """This step's tokens per expert and max/mean imbalance of every MoE layer (all stages)."""
        load = self.expert_load
        if getattr(self.model_args, "moe", None) is None:  # dense model: nothing to gather
            return {}
        if self.pipeline is not None:
            stages: list[dict] = [{} for _ in range(self.dims.pp)]
            dist.all_gather_object(stages, load, group=self.dims.mesh("pp").get_group())
            load = {k: v for stage in stages for k, v in stage.items()}
        if not load:
            return {}
        load = dict(sorted(load.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0))
        return {"moe_load": load, "moe_imbalance": {k: round(v, 4) for k, v in imbalance(load).items()}}

    def shard_sequence(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the sequences under context parallel (all of them otherwise)."""
        if self.cp_positions is None:
            return inputs, labels
        return shard_sequence(inputs, self.cp_positions), shard_sequence(labels, self.cp_positions)

    def global_mean(self, total: torch.Tensor, count: torch.Tensor) -> float:
        """sum(total) / sum(count) over the data- and context-parallel ranks."""
        both = torch.stack([total.double(), count.double()])
        if self.loss_group is not None:
            dist.all_reduce(both, group=self.loss_group)
        mean = both[0] / both[1]
        if self.pipeline is not None:  # only the last stage has the loss: share it along the pipeline
            mean = mean if self.pipeline.has_last else torch.zeros_like(mean)
            dist.all_reduce(mean, group=self.dims.mesh("pp").get_group())
        return mean.item()

    def _validation_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """This rank's validation rows, checked at start-up: rounds of one global batch each."""
        if not self.cfg.validation.enable:
            return None
        if "val" not in self.token_files:
            raise KilnError("validation.enable is set but the dataset has no validation split")
        t = self.cfg.training
        windows = TokenWindows(self.token_files["val"], t.seq_len, self.model_args.vocab_size)
        return validation_batches(windows, self.global_batch // self.dims.dp, self.dp_rank, self.dims.dp,
                                  self.cfg.validation.steps)

    @torch.no_grad()
    def validate(self) -> None:
        """Mean loss over the validation split (validation.steps rounds), logged with val_loss."""
        t = self.cfg.training
        for part in self.model_parts:
            part.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.info.device)
        count = torch.zeros((), dtype=torch.float64, device=self.info.device)
        for inputs, labels in self.val_batches:
            inputs, labels = self.shard_sequence(inputs, labels)
            inputs, labels = inputs.to(self.info.device), labels.to(self.info.device)
            with loss_context(self.use_loss_parallel), self.autocast:
                if self.pipeline is not None:  # a whole step's rows: the schedule's microbatches
                    total += self.pipeline.run(inputs, labels, 1.0, train=False).double()
                else:
                    for x, y in zip(inputs.split(t.local_batch_size), labels.split(t.local_batch_size),
                                    strict=True):
                        total += local_value(self.loss_fn(self.model_parts[0](x), y)).double()
            count += (labels != IGNORE_INDEX).sum()
        for part in self.model_parts:
            part.train()
        tokens = int(count.item()) * self.dims.dp * self.dims.cp
        self.metrics.log_validation(self.state.step, self.global_mean(total, count), tokens)

    def restore(self) -> None:
        """Resume from this run's latest checkpoint, else start from checkpoint.initial_load_path."""
        c = self.checkpoint
        step = c.load()
        if step is not None:
            self.say(f"resumed from {c.folder}/step-{step} ({c.last_load_seconds:.2f} s)")
            return
        path = self.cfg.checkpoint.initial_load_path
        if path:
            if self.cfg.checkpoint.initial_load_in_hf:
                self.load_hf_weights(resolve_path(path))
                return
            parts = ["model"] if self.cfg.checkpoint.initial_load_model_only else list(self.checkpoint.states)
            loaded = c.load_from(resolve_path(path), parts)
            self.say(f"started from {path} ({', '.join(loaded)})")

    def load_hf_weights(self, folder: Path) -> None:
        """Start from a Hugging Face folder: every rank reads the full weights and keeps its shards."""
        if self.spec.state_dict_adapter is None:
            raise KilnError(f"model {self.spec.name!r} has no Hugging Face state-dict adapter")
        from components.hf_io import kiln_state_from_hf  # safetensors + HF config, only needed here

        adapter = self.spec.state_dict_adapter(self.model_args)
        full = kiln_state_from_hf(folder, adapter)
        check_model_matches(ModelState(self.model_parts).state_dict(),
                            {f"model.{k}": tuple(v.shape) for k, v in full.items()}, folder,
                            partial=self.dims.pp > 1)
        for part in self.model_parts:
            set_model_state_dict(part, full, options=StateDictOptions(full_state_dict=True, strict=False))
        self.say(f"started from the Hugging Face weights in {folder}")

    def say(self, line: str) -> None:
        """A console line from the main rank."""
        if self.info.is_main:
            print(line, flush=True)

    def save_checkpoint(self, last: bool) -> None:
        self.checkpoint.save(self.state.step, last=last)
        blocked = self.checkpoint.last_save_seconds["blocked"]
        self.say(f"checkpoint {self.checkpoint.folder}/step-{self.state.step} "
                 f"({'queued' if self.checkpoint.pending else 'saved'}; training blocked {blocked:.2f} s)")

    def train(self) -> None:
        """The loop: batch → step → metrics → validation → checkpoint, until training.steps."""
        cfg, t, st = self.cfg, self.cfg.training, self.state
        self.say(self.summary())
        self.restore()
        # Only now, with the run's input accepted: the resolved config, and a fresh metrics file
        # unless the run resumed (then its rows continue the earlier ones).
        if self.info.is_main:
            # Resolved: data_parallel_shard_degree -1 is written as the degree it became.
            cfg.parallelism.data_parallel_shard_degree = self.dims.dp_shard
            (self.dump / "config.toml").write_text(config_to_toml(cfg))
        self.metrics.open(append=st.step > 0, start_step=st.step)
        stop = StopRequest()
        gc_control = GarbageCollection(t.gc_freq)
        tokens_per_step = self.global_batch * t.seq_len
        pc = cfg.profiling
        snapshots = None
        if pc.enable_memory_snapshot:
            if self.info.device.type == "cuda":
                snapshots = self.dump / pc.save_memory_snapshot_folder
            else:
                self.say("profiling.enable_memory_snapshot: memory snapshots are CUDA-only, none on "
                         f"{self.info.device.type}; peak memory (RSS) is still in every metrics row")
        with maybe_profile(pc.enable_profiling or snapshots is not None, self.dump / pc.save_traces_folder,
                           pc.profile_freq, self.info.rank, pc.profiler_warmup, pc.profiler_active,
                           snapshots) as profiler:
            while st.step < t.steps:
                st.step += 1
                lr = self.schedulers[0].get_last_lr()[0]
                loss_sum, local_tokens, grad_norm = self.train_step(self.loader.batch(st.step))
                st.tokens_seen += tokens_per_step
                self.metrics.count_tokens(tokens_per_step // self.info.world_size)
                last = st.step == t.steps
                if st.step % cfg.metrics.log_freq == 0 or last:
                    loss = self.global_mean(loss_sum, local_tokens)
                    self.metrics.log_step(st.step, loss, grad_norm.item(), lr, st.tokens_seen,
                                          self.moe_metrics())
                if cfg.validation.enable and (st.step % cfg.validation.freq == 0 or last):
                    self.validate()
                preempted = stop.agreed(self.info.device)
                if self.checkpoint.should_save(st.step, last) or (preempted and self.checkpoint.enable):
                    self.save_checkpoint(last)
                self.checkpoint.poll()
                gc_control.maybe_collect(st.step)
                if profiler is not None:
                    profiler.step()
                if preempted:
                    self.say(f"stopping at step {st.step} on signal {stop.received or 'from another rank'}")
                    break
        self.checkpoint.close()
        self.metrics.close()

    def create_seed_checkpoint(self) -> None:
        """Write the initial weights as step-0 (model only) and stop."""
        if self.info.world_size != 1:
            raise KilnError("checkpoint.create_seed_checkpoint runs as one process (python train.py ...)")
        self.checkpoint.save(0, model_only=True)
        self.say(f"seed checkpoint written to {self.checkpoint.folder}/step-0")


def main(argv: list[str]) -> int:
    """Parse, train, and turn every user error into one line on stderr and a non-zero exit code."""
    is_main = os.environ.get("RANK", "0") == "0"
    trainer = None
    timeout = 0
    try:
        cfg = load_config(argv)
        timeout = cfg.comm.timeout_seconds
        info = init_distributed(timeout)
        trainer = Trainer(cfg, info)
        if cfg.checkpoint.create_seed_checkpoint:
            trainer.create_seed_checkpoint()
        else:
            trainer.train()
        code = 0
    except KilnError as e:
        if is_main:
            print(f"kiln: error: {e}", file=sys.stderr, flush=True)
        code = 2
    except Exception as e:
        # A peer's death is reported by every surviving rank, as one line each rather than a trace.
        lost = lost_peer_message(e, timeout) if dist.is_initialized() else None
        if lost is None:
            traceback.print_exc()
        else:
            print(f"kiln: error: {lost}", file=sys.stderr, flush=True)
        code = 1
    release = trainer.dims.release if trainer is not None else None
    exit_cleanly(code, release)
    return code


if __name__ == "__main__":
    main(sys.argv[1:])
