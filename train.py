"""Kiln's trainer: build everything from a JobConfig, run the loop, report, exit cleanly.

    torchrun --nproc-per-node=2 train.py --config llama_debug.toml
    python train.py --config llama_debug.toml --training.steps 20

Read it in run order: Trainer.__init__ names what it builds (model family, tokenizer, layout, data,
model, optimizers and the training step — training/assembly.py, shared with the planner —,
checkpoints, metrics), each builder returning what it built; train() is the loop, then validation
and checkpoints; main() turns errors into one line and a clean exit.
"""

import contextlib
import faulthandler
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from components.checkpoint.manager import CheckpointManager, check_model_matches
from components.checkpoint.states import (
    DataLoaderState,
    MixtureLoaderState,
    ModelState,
    OptimizerState,
    SchedulerState,
    StreamingLoaderState,
    TrainState,
)
from components.config.loading import config_to_dict, config_to_toml, load_config
from components.config.parallel_options import ParallelOptions
from components.config.sections import JobConfig
from components.data.mixture import MixtureLoader
from components.data.run_data import DataRanks, build_run_data, cache_folder
from components.data.tokenizer import Tokenizer
from components.fault_tolerance.replica_groups import ReplicaGroups, check_fault_tolerance, layout_fingerprint
from components.observability.memory_report import MemoryReport
from components.observability.metrics import MetricsLogger, fullest_rank_memory_gib
from components.observability.peak_flops import peak_flops
from components.observability.profiling import maybe_profile
from components.observability.run_summary import (
    RunEnd,
    RunFacts,
    compiled_graphs,
    end_summary,
    startup_summary,
)
from components.observability.wandb_run import WandbOptions
from components.observability.weights_digest import weights_digest
from components.optim.expert_balance import imbalance
from components.quantization.converters import (
    ConverterContext,
    after_optimizer_step,
    convert_model,
    resolve_converters,
)
from components.runtime.agent_watch import watch_agent
from components.runtime.distributed import (
    DistInfo,
    exit_cleanly,
    init_distributed,
    local_rank_zero_first,
    lost_peer_message,
    set_seed,
)
from components.runtime.errors import KilnError, report_kiln_error, reported_elsewhere
from components.runtime.filesystem import check_paths, keep_earlier_run, require_writable, unseen_by
from components.runtime.hub import resolve_asset
from components.runtime.loop_control import GarbageCollection, StopRequest
from parallelisms.materialize import materialize_and_init
from parallelisms.parallel_dims import ParallelDims
from training.assembly import (
    ModelParts,
    build_layout,
    build_model_parts,
    build_optimizers,
    build_train_step,
    load_model_family,
)


class Trainer:
    """One training run: model, data, optimizer and metrics built from the config, then the loop."""

    def __init__(self, cfg: JobConfig, info: DistInfo) -> None:
        self.cfg, self.info = cfg, info
        set_seed(cfg.training.seed, cfg.training.deterministic)
        ft = cfg.fault_tolerance
        check_fault_tolerance(ft)
        # Each replica group keeps its own records; the checkpoints are the job's.
        self.dump = Path(cfg.job.dump_folder) / (f"replica_{ft.replica_id}" if ft.enable else "")
        check_paths(cfg)
        self.spec, self.model_args = load_model_family(cfg)
        self.tokenizer = self._build_tokenizer()
        self.options = ParallelOptions.from_config(cfg, info.device.type)
        self.dims, self.global_batch = self._build_layout()
        self.converter_ctx = ConverterContext(cfg, self.dims.fsdp_enabled, self.dims.tp > 1, info.device.type)
        self.converters = resolve_converters(cfg.model.converters, self.converter_ctx)
        # Under fault tolerance a step's batch is split over every replica group, live or not.
        groups = ft.group_size if ft.enable else 1
        self.data = build_run_data(cfg, self.tokenizer, self.model_args.vocab_size,
                                   self.global_batch * groups, self._data_ranks())
        # Started before the model exists: on CPU it records every tensor allocation from here on
        # (the corpus, host memory on a GPU machine, is left out).
        self.memory_report = (MemoryReport(info.device, self.dump / f"memory_rank{info.rank}.json", self.dims)
                              if cfg.profiling.memory_report else None)
        self.model = self._build_model()
        self.flops_per_token = self.spec.flops_per_token_fn(self.model_args, self.model.num_params,
                                                            cfg.training.seq_len)
        self.optimizers, self.schedulers = build_optimizers(cfg, self.model, info.device.type)
        self.train_step = build_train_step(cfg, self.model, self.optimizers, self.schedulers, self.dims,
                                           self.options, info.device, self.global_batch,
                                           self._after_optimizer_step_hook())
        # A mixture's per-source losses are summed from each row's loss.
        self.train_step.per_row_losses = isinstance(self.data.loader, MixtureLoader)
        if self.memory_report is not None:
            self.memory_report.watch(self.model.parts, self.optimizers)
        self.state = TrainState()
        self.last_checkpoint: Path | None = None
        self.checkpoint = self._build_checkpointing()
        # One process per node measures the CPU peak for MFU while the others wait, then read its cache.
        self.peak = local_rank_zero_first(info.local_rank,
                                          lambda: peak_flops(info.device, cfg.metrics.peak_tflops))
        self.metrics = self._build_metrics()
        self.replicas = self._build_replicas() if ft.enable else None

    # ------------------------------------------------------------------ building

    def _after_optimizer_step_hook(self) -> Callable[[], None] | None:
        """The converters' after-step work, or None when no converter has any (nothing on the step's
        hot path then)."""
        if not any(c.after_optimizer_step for c in self.converters):
            return None
        return lambda: after_optimizer_step(self.model.parts, self.converters, self.converter_ctx)

    def _build_tokenizer(self) -> Tokenizer:
        """The tokenizer, which must fit the model's vocabulary (as training.seq_len its positions)."""
        cfg, args = self.cfg, self.model_args
        tokenizer = Tokenizer(resolve_asset(cfg.model.tokenizer_path, ["tokenizer"]))
        if tokenizer.vocab_size > args.vocab_size:
            raise KilnError(f"tokenizer {cfg.model.tokenizer_path} has {tokenizer.vocab_size} tokens but "
                            f"model {cfg.model.name}/{cfg.model.flavor} has a vocabulary of "
                            f"{args.vocab_size}")
        return tokenizer

    def _build_layout(self) -> tuple[ParallelDims, int]:
        """The degrees, checked against the world, the model and the run (every problem at once), then
        one mesh; and the global batch size."""
        dims, global_batch = build_layout(self.cfg, self.spec, self.model_args, self.info.world_size,
                                          self.options, self.info.device.type)
        dims.build_mesh(self.info.device.type)
        return dims, global_batch

    def _data_ranks(self) -> DataRanks:
        """This rank's rows of a batch, and its share of tokenizing a new corpus: every rank of the job
        takes part when the cache folder is shared, else the ranks of each node tokenize for it."""
        info = self.info
        worker, workers = info.rank, info.world_size
        if info.nodes > 1:
            cache = cache_folder(self.cfg)
            require_writable(cache, "training.data_cache_dir")
            if unseen_by(cache, self.cfg.checkpoint.shared_folder_wait_seconds):
                worker, workers = info.local_rank, info.world_size // info.nodes
        dp_mesh = self.dims.mesh("dp")
        dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
        ft = self.cfg.fault_tolerance
        if ft.enable:  # replica group g reads as data-parallel ranks g·dp .. g·dp + dp - 1 would
            return DataRanks(ft.replica_id * self.dims.dp + dp_rank, self.dims.dp * ft.group_size, worker,
                             workers, info.is_main)
        return DataRanks(dp_rank, self.dims.dp, worker, workers, info.is_main)

    def _build_model(self) -> ModelParts:
        """The model on the meta device, cut into this rank's pipeline stages, each parallelized and
        then materialised with layout-free initial weights."""
        args = self.model_args
        model = build_model_parts(self.spec, args, self.dims, self.options,
                                  lambda whole: convert_model(whole, self.converters, self.converter_ctx))
        for part in model.parts:
            materialize_and_init(part, lambda: self.spec.model_cls(args), self.cfg.training.seed,
                                 self.info.device)
            part.train()
            self._set_document_mask(part)
        return model

    def _set_document_mask(self, part: torch.nn.Module) -> None:
        """training.document_mask: tell the model its BOS token (models/protocol.py's hook)."""
        t = self.cfg.training
        if t.document_positions_restart and not t.document_mask:
            raise KilnError("training.document_positions_restart needs training.document_mask")
        if not t.document_mask:
            return
        if not hasattr(part, "document_bos_id"):
            raise KilnError(f"training.document_mask needs the model hook `document_bos_id` "
                            f"(models/protocol.py); model {self.spec.name!r} lacks it")
        part.document_bos_id = self.tokenizer.bos_id
        part.restart_positions = t.document_positions_restart

    def _build_checkpointing(self) -> CheckpointManager:
        """Every Stateful part of the run, saved and loaded together."""
        c, streaming = self.cfg.checkpoint, self.cfg.training.dataset_mode == "streaming"
        # The optimizer state keeps one copy of a tied weight.
        states = {"model": ModelState(self.model.parts),
                  "optimizer": OptimizerState(self.model.parts, self.optimizers, aliases={
                      name: names[0] for names in self.model.tied_names for name in names[1:]}),
                  "lr_scheduler": SchedulerState(self.schedulers),
                  "dataloader": self._loader_state(streaming),
                  "train_state": self.state}
        return CheckpointManager(
            Path(self.cfg.job.dump_folder) / c.folder, states, enable=c.enable or c.create_seed_checkpoint,
            interval=c.interval,
            keep_latest_k=c.keep_latest_k, load_step=c.load_step, async_mode=c.async_mode,
            last_save_model_only=c.last_save_model_only, export_dtype=c.export_dtype,
            exclude_from_loading=c.exclude_from_loading, is_main=self.info.is_main,
            partial_model=self.dims.pp > 1, shared_folder_wait_seconds=c.shared_folder_wait_seconds)

    def _loader_state(self, streaming: bool) -> Stateful:
        """The data loader's part of a checkpoint: a stream's positions, a mixture's phase and
        positions, or (one dataset) what the order depends on besides the step."""
        if streaming:
            return StreamingLoaderState(self.data.loader)
        if isinstance(self.data.loader, MixtureLoader):
            return MixtureLoaderState(self.data.loader, self.state)
        return DataLoaderState(self.data.loader)

    def _build_metrics(self) -> MetricsLogger:
        """Console, metrics.jsonl, TensorBoard and W&B; MFU against self.peak."""
        m = self.cfg.metrics
        tb = self.dump / m.save_tb_folder if m.enable_tensorboard else None
        wandb = (WandbOptions(m.wandb_project, m.wandb_run_name, m.wandb_run_id, config_to_dict(self.cfg))
                 if m.enable_wandb else None)
        return MetricsLogger(self.dump, is_main=self.info.is_main, device=self.info.device,
                             flops_per_token=self.flops_per_token, peak=self.peak,
                             total_steps=self.cfg.training.steps, tensorboard_dir=tb, wandb=wandb,
                             replica_groups=self.cfg.fault_tolerance.group_size
                             if self.cfg.fault_tolerance.enable else 0)

    def _build_replicas(self) -> ReplicaGroups:
        """This group's torchft Manager: what a joining group heals from, and the gradient average
        across the live groups."""
        cfg, d = self.cfg, self.dims
        if cfg.training.dataset_mode == "streaming":
            raise KilnError("fault_tolerance.enable cannot heal a streaming loader's per-rank positions: "
                            "train from a file, a mixture or a prepared folder")
        layout = (f"{cfg.model.name}/{cfg.model.flavor} {self.model.num_params} world {d.world_size} "
                  f"dp {d.dp_replicate}x{d.dp_shard} tp {d.tp} pp {d.pp} cp {d.cp} ep {d.ep} "
                  f"batch {self.global_batch} seq {cfg.training.seq_len} {cfg.fault_tolerance.semi_sync}")
        replicas = ReplicaGroups(cfg.fault_tolerance, self.info.rank, self.info.world_size, self.info.device,
                                 layout_fingerprint(layout))
        replicas.register_state(self.checkpoint.states)
        replicas.attach(self.model.parts)
        self.train_step.replicas = replicas
        return replicas

    def summary(self) -> str:
        """The start-up lines: model, layout, batch, data, precision and the MFU peak."""
        d, a, model = self.dims, self.model_args, self.model
        lines = startup_summary(self.cfg, RunFacts(
            num_params=model.num_params, embedding_params=a.vocab_size * a.dim,
            flops_per_token=self.flops_per_token, layout=d.describe(
                self.options, model.num_stages, self.train_step.pipeline_microbatches,
                any(getattr(part, "tp_sequence_parallel", False) for part in model.parts)),
            world_size=d.world_size, nodes=self.info.nodes,
            backend=dist.get_backend() if dist.is_initialized() else "none",
            device_type=self.info.device.type, global_batch=self.global_batch,
            microbatches=self.data.loader.microbatches, data=self.data.description,
            mtp_depth=model.mtp_depth, dump=self.dump,
            numerics=self._numerics(), peak=self.peak))
        if self.cfg.comm.gloo_accelerations:  # opt-in, so said whenever asked for
            done = "; ".join(self.model.accelerations) or "none apply to this layout or backend"
            lines += f"\ncomm    gloo accelerations: {done}"
        return lines

    def _numerics(self) -> str:
        """The dtypes the layout really computes and reduces in (FSDP casts; elsewhere autocast)."""
        o, fsdp = self.options, self.dims.data_parallel_enabled
        reduce = f", gradients reduced in {o.reduce_dtype}" if fsdp else ""
        converted = "".join(f"; {self._converter_words(c.name)}" for c in self.converters)
        if o.param_dtype == "float32":
            return f"compute float32{reduce}{converted}"
        how = "FSDP casts the float32 parameters" if fsdp else "autocast over float32 parameters"
        return f"compute bfloat16 ({how}){reduce}{converted}"

    def _converter_words(self, name: str) -> str:
        """How the summary names a model converter (float8: its recipe and all-gather)."""
        if name != "float8":
            return f"converter {name}"
        from components.quantization.float8 import fsdp_float8_all_gather

        gather = ", all-gathered in float8" if fsdp_float8_all_gather(self.converter_ctx) else ""
        return f"float8 block linears ({self.cfg.float8.recipe_name}{gather})"

    # ------------------------------------------------------------------ the loop

    def train(self) -> None:
        """The loop: batch → step → metrics → validation → checkpoint, until training.steps."""
        cfg, t, st = self.cfg, self.cfg.training, self.state
        self.say(self.summary())
        resumed = self.restore() and st.step > 0  # a seed checkpoint (step-0) starts a new run
        if self.replicas is not None:
            self.replicas.set_step(st.step)
        if st.step >= t.steps:
            self.say(f"nothing to do: the run already reached step {st.step} (training.steps = {t.steps}); "
                     "raise training.steps to train further")
            self.checkpoint.close()
            return
        if not resumed:
            self._keep_earlier_records()
        self._write_resolved_config()
        # A fresh metrics file unless the run resumed (then its rows continue the earlier ones).
        self.metrics.open(append=resumed, start_step=st.step)
        stop, gc_control = StopRequest(), GarbageCollection(t.gc_freq)
        tokens_per_step = self.global_batch * t.seq_len  # of this replica group, under fault tolerance
        first_step, first_tokens, started, stopped_by = st.step, st.tokens_seen, time.perf_counter(), ""
        with self._profiler() as profiler, self._semi_sync():
            while st.step < t.steps:
                if not self._join_step():
                    break
                st.step += 1
                lr = self.schedulers[0].get_last_lr()[0]
                if self.memory_report is not None:
                    self.memory_report.step_begins(st.step)
                loss_sum, local_tokens, grad_norm = self.train_step(self.data.loader.batch(st.step))
                if self.memory_report is not None:
                    self.memory_report.step_ends(st.step, self.model.parts, self.optimizers)
                if not self.train_step.committed:
                    self.say(f"step {st.step} discarded: a replica group failed during it; it runs again "
                             "with the live groups")
                    st.step -= 1
                    continue
                st.tokens_seen += tokens_per_step * self.live_groups()
                self.metrics.count_tokens(tokens_per_step // self.info.world_size)
                last = st.step == t.steps
                if st.step % cfg.metrics.log_freq == 0 or last:
                    loss, loss_tokens = self.train_step.global_mean(loss_sum, local_tokens)
                    self.metrics.log_step(st.step, loss, grad_norm.item(), lr, st.tokens_seen,
                                          {"loss_tokens": loss_tokens, **self.mtp_metrics(),
                                           **self.source_metrics(st.step), **self.moe_metrics(),
                                           **self.replica_metrics(st.step)})
                if cfg.validation.enable and (st.step % cfg.validation.freq == 0 or last):
                    self.validate()
                preempted = stop.agreed(self.info.device)
                if ((self.checkpoint.should_save(st.step, last) or (preempted and self.checkpoint.enable))
                        and (self.replicas is None or self.replicas.writes_checkpoints())):
                    self.save_checkpoint(last)
                self.checkpoint.poll()
                gc_control.maybe_collect(st.step)
                if profiler is not None:
                    profiler.step()
                if preempted:
                    stopped_by = (signal.Signals(stop.received).name if stop.received
                                  else "a signal to another rank")
                    self.say(f"stopping at step {st.step} on {stopped_by}")
                    break
        self.checkpoint.close()
        self.metrics.close()
        self.say(end_summary(RunEnd(
            first_step=first_step, last_step=st.step, total_steps=t.steps, tokens=st.tokens_seen,
            session_tokens=st.tokens_seen - first_tokens, session_seconds=time.perf_counter() - started,
            run_seconds=self.metrics.run_time(), world_size=self.info.world_size,
            last_row=self.metrics.last_row, last_val=self.metrics.last_val,
            peak_mem_gib=fullest_rank_memory_gib(self.info.device),
            checkpoint=self.last_checkpoint, checkpointing=self.checkpoint.enable, dump=self.dump,
            stopped_by=stopped_by, compiled_graphs=compiled_graphs() if cfg.compile.enable else None)))
        if self.replicas is not None:
            if self.replicas.per_step:  # DiLoCo's outer steps commit on their own
                self.say(self.replicas.summary())
            self.replicas.shutdown()

    def _semi_sync(self) -> contextlib.AbstractContextManager:
        """DiLoCo around the loop (fault_tolerance.semi_sync), else nothing."""
        if self.replicas is None or self.replicas.per_step:
            return contextlib.nullcontext()
        from components.fault_tolerance.diloco import diloco

        return diloco(self.replicas.manager, self.model.parts, self.optimizers, self.cfg.fault_tolerance)

    def _join_step(self) -> bool:
        """Under fault tolerance, join this step's quorum of replica groups first (a group that is
        behind heals here and continues from the live groups' step); False when a heal took the run
        to its end."""
        if self.replicas is None or not self.replicas.per_step:
            return True
        heals = len(self.replicas.events.heals)
        self.replicas.start_step()
        if len(self.replicas.events.heals) > heals:
            self.say(f"healed from a live replica group in {self.replicas.events.heals[-1]:.2f} s: weights, "
                     f"optimizer, LR schedule and data position now at step {self.state.step}")
        return self.state.step < self.cfg.training.steps

    def live_groups(self) -> int:
        """Replica groups that took part in the step (1 without fault tolerance)."""
        if self.replicas is None:
            return 1
        if self.replicas.per_step:
            return len(self.replicas.events.live)
        return max(self.replicas.manager.num_participants(), 1)

    def replica_metrics(self, step: int) -> dict:
        """Under fault tolerance: the live groups of the step, the lines about groups that came or
        went, and (every fault_tolerance.weights_digest_freq steps) the weights' digest."""
        if self.replicas is None:
            return {}
        for line in self.replicas.take_lines():
            self.say(line)
        row = {"replicas": self.live_groups()}
        every = self.cfg.fault_tolerance.weights_digest_freq
        if every and step % every == 0:
            row["weights_digest"] = weights_digest(self.model.parts)
            row["optimizer_digest"] = weights_digest(self.model.parts, self.optimizers)
        return row

    def _keep_earlier_records(self) -> None:
        """A new run (nothing resumed) in a folder holding another run's records moves them aside."""
        if not self.info.is_main:
            return
        kept = keep_earlier_run(self.dump, self.cfg.metrics.save_tb_folder)
        if kept is not None:
            self.say(f"this is a new run: the earlier run's records in {self.dump} (metrics.jsonl, "
                     f"config.toml, ...) were moved to {kept}")

    def _write_resolved_config(self) -> None:
        """config.toml, written only now that the run's input was accepted; data_parallel_shard_degree
        -1 is written as the degree it became."""
        if self.info.is_main:
            self.cfg.parallelism.data_parallel_shard_degree = self.dims.dp_shard
            (self.dump / "config.toml").write_text(config_to_toml(self.cfg))

    def _profiler(self) -> contextlib.AbstractContextManager:
        """torch.profiler traces (and CUDA memory snapshots) at the configured steps, or nothing."""
        pc, device = self.cfg.profiling, self.info.device
        snapshots = self.dump / pc.save_memory_snapshot_folder if pc.enable_memory_snapshot else None
        if snapshots is not None and device.type != "cuda":
            self.say("profiling.enable_memory_snapshot: memory snapshots are CUDA-only, none on "
                     f"{device.type}; peak memory (RSS) is still in every metrics row")
            snapshots = None
        return maybe_profile(pc.enable_profiling, self.dump / pc.save_traces_folder,
                             pc.profile_freq, self.info.rank, pc.profiler_warmup, pc.profiler_active,
                             snapshots)

    # ------------------------------------------------------------------ one step

    def source_metrics(self, step: int) -> dict:
        """A mixture's loss (mean per token) and labelled tokens of each source in this step."""
        loader = self.data.loader
        if not isinstance(loader, MixtureLoader):
            return {}
        losses, tokens = self.train_step.row_sums(torch.cat(loader.sources_of(step)), len(loader.names))
        return {"source_loss": {n: (loss / count).item() if count > 0 else None
                                for n, loss, count in zip(loader.names, losses, tokens, strict=True)},
                "source_tokens": {n: int(count) for n, count in zip(loader.names, tokens, strict=True)}}

    def mtp_metrics(self) -> dict:
        """This step's multi-token prediction loss (mean over its depths and tokens), if the model has MTP."""
        step = self.train_step
        if not step.mtp_depth:
            return {}
        loss, _ = step.global_mean(step.mtp_sum, step.mtp_count)
        return {"mtp_loss": loss}

    def moe_metrics(self) -> dict:
        """This step's tokens per expert and max/mean imbalance of every MoE layer (all stages)."""
        if getattr(self.model_args, "moe", None) is None:  # dense model: nothing to gather
            return {}
        load = self.train_step.expert_load_of_all_stages()
        if not load:
            return {}
        return {"moe_load": load, "moe_imbalance": {k: round(v, 4) for k, v in imbalance(load).items()}}

    # ------------------------------------------------------------------ validation

    def validate(self) -> None:
        """Mean loss over the validation split (validation.steps rounds), logged with val_loss."""
        rows = self.cfg.training.local_batch_size
        if self.data.val_sources is None:
            loss, tokens = self.train_step.evaluate(self.data.val_batches, rows)
            self.metrics.log_validation(self.step, loss, tokens)
            return
        # A mixture: each source's validation split, and the mean over all their tokens.
        results = {name: self.train_step.evaluate(batches, rows)
                   for name, batches in self.data.val_sources.items()}
        tokens = sum(n for _, n in results.values())
        loss = sum(mean * n for mean, n in results.values()) / tokens
        self.metrics.log_validation(self.step, loss, tokens,
                                    {name: mean for name, (mean, _) in results.items()})

    # ------------------------------------------------------------------ checkpoints

    def restore(self) -> bool:
        """Resume from this run's latest checkpoint (returns True), else start from
        checkpoint.initial_load_path, if any (a new run: returns False)."""
        c, cc = self.checkpoint, self.cfg.checkpoint
        step = c.load()
        if step is not None:
            self.last_checkpoint = c.folder / f"step-{step}"
            self.say(f"resumed from {self.last_checkpoint} ({c.last_load_seconds:.2f} s)")
            return True
        if not cc.initial_load_path:
            return False
        if cc.initial_load_in_hf:  # a hub id: its config and weights, through the Hugging Face cache
            self.load_hf_weights(resolve_asset(cc.initial_load_path, ["config", "weights"]))
            return False
        parts = ["model"] if cc.initial_load_model_only else list(c.states)
        source = resolve_asset(cc.initial_load_path, None)
        c.require_intact(source, "checkpoint.initial_load_path")
        loaded = c.load_from(source, parts)
        self.say(f"started from {cc.initial_load_path} ({', '.join(loaded)})")
        return False

    def load_hf_weights(self, folder: Path) -> None:
        """Start from a Hugging Face folder: every rank reads the full weights and keeps its shards."""
        if self.spec.state_dict_adapter is None:
            raise KilnError(f"model {self.spec.name!r} has no Hugging Face state-dict adapter")
        from components.checkpoint.hf_folder import kiln_state_from_hf

        full = kiln_state_from_hf(folder, self.spec.state_dict_adapter(self.model_args))
        check_model_matches(ModelState(self.model.parts).state_dict(),
                            {f"model.{k}": tuple(v.shape) for k, v in full.items()}, folder,
                            partial=self.dims.pp > 1)
        for part in self.model.parts:
            set_model_state_dict(part, full, options=StateDictOptions(full_state_dict=True, strict=False))
        self.say(f"started from the Hugging Face weights in {folder}")

    def save_checkpoint(self, last: bool) -> None:
        self.checkpoint.save(self.step, last=last)
        self.last_checkpoint = self.checkpoint.folder / f"step-{self.step}"
        blocked = self.checkpoint.last_save_seconds["blocked"]
        self.say(f"checkpoint {self.checkpoint.folder}/step-{self.step} "
                 f"({'queued' if self.checkpoint.pending else 'saved'}; training blocked {blocked:.2f} s)")

    def create_seed_checkpoint(self) -> None:
        """Write the initial weights as step-0 (model only) and stop: each rank writes its shards, so
        any world size makes it and no rank ever holds the whole model."""
        self.checkpoint.save(0, model_only=True)
        peak = fullest_rank_memory_gib(self.info.device)
        self.say(f"seed checkpoint written to {self.checkpoint.folder}/step-0 "
                 f"({self.model.num_params / 1e6:,.0f}M parameters; peak memory {peak:.2f} GiB on the "
                 f"fullest of {self.info.world_size} rank(s))")

    @property
    def step(self) -> int:
        """The number of the last step taken (the train state's, saved in every checkpoint)."""
        return self.state.step

    def say(self, line: str) -> None:
        """A console line from the main rank."""
        if self.info.is_main:
            print(line, flush=True)


def main(argv: list[str]) -> int:
    """Parse, train, and turn every user error into one line on stderr (from whichever rank finds it)
    and a non-zero exit code."""
    rank = int(os.environ.get("RANK", "0"))
    watch_agent()  # first: a worker whose agent is gone stops at once
    # A crash in native code (a segfault in a kernel or a collective's thread) prints every thread's
    # Python stack to stderr instead of dying silently with torchrun's "exit -11".
    faulthandler.enable(all_threads=True)
    trainer, store, timeout = None, None, 0
    try:
        cfg = load_config(argv)
        timeout = cfg.comm.timeout_seconds
        info = init_distributed(timeout)
        store = info.store
        trainer = Trainer(cfg, info)
        if cfg.checkpoint.create_seed_checkpoint:
            trainer.create_seed_checkpoint()
        else:
            trainer.train()
        code = 0
    except KilnError as e:
        report_kiln_error(e, rank, store)
        code = 2
    except Exception as e:
        code = report_crash(e, timeout, store)
    exit_cleanly(code, trainer.dims.release if trainer is not None else None)
    return code


def report_crash(error: Exception, timeout: int, store: object) -> int:
    """An unexpected exception: silent when it echoes another rank's reported user error (a
    collective failed because that rank left), one line when a peer died, else the traceback."""
    if reported_elsewhere(store):
        return 2
    lost = lost_peer_message(error, timeout) if dist.is_initialized() else None
    if lost is None:
        traceback.print_exc()
    else:  # a peer's death, said by every surviving rank in one line rather than a trace
        print(f"kiln: error: {lost}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    main(sys.argv[1:])
