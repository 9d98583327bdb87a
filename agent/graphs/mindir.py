"""MindIR: the four graphs written as files by `mindspore.export` (upstream's deployment artefacts),
and run from those files (`mindspore.load` + `nn.GraphCell`) instead of being built from code.

In the exported prefill and decode graphs the KV cache is a list of graph inputs (k0, v0, k1, v1, ...)
rather than Parameters: a file then carries the weights but no cache, and every loaded graph writes
in place into the one cache the runner owns and passes in. Each file carries its own copy of the
weights; at load the copies are pointed at the first file's, so memory holds them once.

An export directory holds the .mindir files, manifest.json (the model spec, the runtime shapes and
which file is which graph) and the tokenizer files; tools.export writes it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn

from agent.graphs.interface import GraphInputs, StateMoves, shape_settings, uses_kernels
from agent.graphs.layers import release_freed_memory
from agent.graphs.model import DecoderModel
from agent.graphs.step_graphs import StepGraphs, as_tensors, logits_and_argmax, topk_buckets
from agent.kernels import BUILD_ROOT, build_id
from agent.known_answer import FILE_NAME as KNOWN_ANSWER_FILE
from agent.known_answer import KnownAnswer
from agent.model.checkpoint import Checkpoint
from agent.model.spec import ModelSpec
from config.schema import ModelSection, RuntimeSection

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# Version of what the graphs take and return: 2 = decode graphs return (logits, argmax), and prefill
# graphs of fused layers take write rows and lengths (manifest "fused_layers"); 3 = the export holds
# its known answer (agent/known_answer.py) and the MindSpore version and kernel build it was made with;
# 4 = a paged KV cache (runtime.block_size): prefill and decode graphs take block tables; 5 = a pool
# of runtime.num_blocks blocks shared by the slots, then the scratch blocks.
EXPORT_FORMAT = 5


class MindIRError(ValueError):
    """MindIR files that cannot serve this configuration; the message says which and why."""


# ------------------------------------------------------------------------------------- export


class ExportPrefillGraph(nn.Cell):
    """PrefillGraph with the KV cache passed in."""

    def __init__(self, model: DecoderModel):
        super().__init__()
        self.model = model
        self.num_layers = len(model.layers)

    def construct(self, tokens, positions, write_idx, mask, last_index, tables, row_table, *caches):
        x, cos, sin = self.model.embed_tokens(tokens, positions)
        states = self.model.no_state_slots  # an exported model has no Gated DeltaNet layers (refused)
        for i in range(self.num_layers):
            k_cache, v_cache = caches[2 * i], caches[2 * i + 1]
            x = self.model.layers[i].prefill(
                x, cos, sin, self.model.rot, write_idx, mask, tables, row_table, k_cache, v_cache, states
            )
        return self.model.logits(ms.ops.gather(x, last_index, 0))


class ExportDecodeGraph(nn.Cell):
    """DecodeGraph with the KV cache passed in."""

    def __init__(self, model: DecoderModel):
        super().__init__()
        self.model = model
        self.num_layers = len(model.layers)

    def construct(self, tokens, positions, write_idx, where, extent, row_table, *caches):
        x, cos, sin = self.model.embed_tokens(tokens, positions)
        states = self.model.no_state_slots  # an exported model has no Gated DeltaNet layers (refused)
        for i in range(self.num_layers):
            k_cache, v_cache = caches[2 * i], caches[2 * i + 1]
            x = self.model.layers[i].decode(
                x, cos, sin, self.model.rot, write_idx, where, extent, row_table, k_cache, v_cache, states
            )
        return logits_and_argmax(self.model.logits(x))


class GraphExporter:
    """agent.graphs.interface.ModelGraphs, but each call exports its graph with the call's inputs as
    the example shapes (ModelRunner.warm_up calls every shape once) and returns zeros."""

    def __init__(self, checkpoint: Checkpoint, runtime: RuntimeSection, directory: Path):
        if runtime.paged_attention:
            raise MindIRError(
                "the paged backend's graphs (decode_attention paged, Ascend's) run in MindSpore's predict "
                "phase from code and are not exported: serve the model from its checkpoint"
            )
        self.code = StepGraphs(checkpoint, runtime)
        if self.code.inputs.ring:
            raise MindIRError(
                "a model with sliding-window layers (their per-slot rings) is not exported: serve it "
                "from its checkpoint"
            )
        self.spec, self.topk_buckets, self.inputs = self.code.spec, self.code.topk_buckets, self.code.inputs
        self.directory = directory
        model = self.code.model
        self.caches = [c for layer in model.layers for c in (layer.k_cache, layer.v_cache)]
        self.prefill_cell, self.decode_cell = ExportPrefillGraph(model), ExportDecodeGraph(model)
        self.files: dict[str, list[dict]] = {
            "prefill_model": [],
            "decode_model": [],
            "argmax_model": [],
            "topk_model": [],
        }

    def _export(self, cell: nn.Cell, inputs, name: str, kind: str, **shape) -> None:
        ms.export(cell, *inputs, file_name=str(self.directory / name), file_format="MINDIR")
        self.files[kind].append({"file": f"{name}.mindir", **shape})

    def _logits(self, rows: int) -> Tensor:
        return Tensor(np.zeros((rows, self.spec.vocab_size), np.float32))

    def prefill(
        self,
        table: np.ndarray,
        tokens: np.ndarray,
        length: int,
        start: int = 0,
        slot: int | None = None,
        every_row: bool = False,
        moves: StateMoves | None = None,
    ) -> Tensor:
        if every_row:  # exported with the last row's logits only
            raise ValueError("MindIR graphs compute no prompt logprobs (every row's logits)")
        inputs = as_tensors(self.inputs.prefill(table, tokens, length, start))
        self._export(
            self.prefill_cell, (*inputs, *self.caches), f"prefill_{length}", "prefill_model", length=length
        )
        return self._logits(1)

    def decode(
        self,
        tables: np.ndarray,
        tokens: np.ndarray,
        positions: np.ndarray,
        rows: int,
        attend: int = 0,
        slots: Sequence[int] | None = None,
        moves: StateMoves | None = None,
    ) -> tuple[Tensor, Tensor]:
        inputs = as_tensors(self.inputs.decode(tables, tokens, positions, rows, attend))
        name = f"decode_b{rows}" + (f"_a{attend}" if attend else "")
        self._export(
            self.decode_cell, (*inputs, *self.caches), name, "decode_model", rows=rows, attend=attend
        )
        return self._logits(rows), Tensor(np.zeros(rows, np.int32))

    def argmax(self, logits: Tensor) -> Tensor:
        self._export(self.code.argmax_graph, (_any_rows(logits),), "argmax", "argmax_model")
        return Tensor(np.zeros(logits.shape[0], np.int32))

    def topk(self, k: int, logits: Tensor) -> tuple[Tensor, Tensor]:
        self._export(self.code.topk_graphs[k], (_any_rows(logits),), f"topk_{k}", "topk_model", k=k)
        return self._logits(logits.shape[0]), self._logits(logits.shape[0])

    def cache_bytes(self) -> int:
        return self.code.cache_bytes()

    def write_manifest(self, runtime: RuntimeSection, known: KnownAnswer) -> Path:
        """manifest.json and the known answer the loaded graphs must reproduce."""
        known.save(self.directory)
        path = self.directory / MANIFEST
        path.write_text(
            json.dumps(
                {
                    "format": EXPORT_FORMAT,
                    "spec": json.loads(self.spec.model_dump_json()),
                    "runtime": shape_settings(runtime),
                    "fused_layers": self.inputs.fused_layers,
                    "mindspore": ms.__version__,
                    "kernels": build_id() if uses_kernels(runtime) else None,
                    "graphs": self.files,
                },
                indent=1,
            )
        )
        return path


def _any_rows(logits: Tensor) -> Tensor:
    """The post-process graphs take any number of rows."""
    return Tensor(shape=[None, logits.shape[1]], dtype=logits.dtype)


# --------------------------------------------------------------------------------------- load


def argmax_file(files: ModelSection) -> Path:
    """The configured argmax graph: the model section names one where it selects MindIR files."""
    if files.argmax_model is None:
        raise MindIRError("model.argmax_model is not set: no MindIR export is configured")
    return files.argmax_model


def read_manifest(files: ModelSection) -> dict:
    """manifest.json beside the configured files (tools.export writes it there)."""
    path = argmax_file(files).parent / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MindIRError(f"cannot read {path} (tools.export writes it beside the graphs): {exc}") from exc
    manifest["path"] = path
    return manifest


def read_spec(files: ModelSection) -> ModelSpec:
    return ModelSpec.model_validate(read_manifest(files)["spec"])


def read_known_answer(files: ModelSection) -> KnownAnswer:
    directory = argmax_file(files).parent
    try:
        return KnownAnswer.load(directory)
    except (OSError, ValueError, KeyError) as exc:
        raise MindIRError(
            f"cannot read {directory / KNOWN_ANSWER_FILE} (tools.export writes it beside the "
            f"graphs; export again): {exc}"
        ) from exc


class MindIRGraphs:
    """agent.graphs.interface.ModelGraphs over MindIR files, with the KV cache held here."""

    def __init__(
        self, files: ModelSection, runtime: RuntimeSection, progress: Callable[[str], None] = log.info
    ):
        manifest = read_manifest(files)
        manifest_path = manifest["path"]
        if manifest.get("format") != EXPORT_FORMAT:
            raise MindIRError(
                f"the MindIR graphs in {manifest_path.parent} were exported by another version "
                f"(format {manifest.get('format', 1)}, this one reads {EXPORT_FORMAT}): export "
                f"them again (python -m tools.export)"
            )
        if manifest.get("mindspore") != ms.__version__:
            raise MindIRError(
                f"the MindIR graphs in {manifest_path.parent} were exported with MindSpore "
                f"{manifest.get('mindspore')}, this is {ms.__version__}: export them again"
            )
        if manifest["kernels"] is not None and not (BUILD_ROOT / manifest["kernels"]).is_dir():
            raise MindIRError(
                f"the MindIR graphs in {manifest_path.parent} call CPU kernels of build "
                f"{manifest['kernels']}, which {BUILD_ROOT} no longer holds: export them again"
            )
        self.spec = ModelSpec.model_validate(manifest["spec"])
        _check_runtime(manifest["runtime"], shape_settings(runtime), manifest_path)
        by_file = {g["file"]: (kind, g) for kind, graphs in manifest["graphs"].items() for g in graphs}
        listed = {
            "prefill_model": files.prefill_model,
            "decode_model": files.decode_model,
            "argmax_model": [argmax_file(files)],
            "topk_model": files.topk_model,
        }
        for kind, paths in listed.items():
            for path in paths:
                if by_file.get(path.name, (None,))[0] != kind:
                    raise MindIRError(f"{path}: not a {kind} graph of the export in {manifest_path.parent}")
        # how the prefill graphs take their inputs: the export's layers decided it
        self.inputs = GraphInputs(
            runtime, self.spec.num_kv_heads, self.spec.group_size, fused_layers=manifest["fused_layers"]
        )
        rows = (self.inputs.cache_rows, self.spec.head_dim)
        self.caches = [
            Parameter(
                Tensor(np.zeros(rows, np.float32), dtype=getattr(ms, runtime.dtype)),
                name=f"kv_cache_{i}",
                requires_grad=False,
            )
            for i in range(2 * self.spec.num_layers)
        ]
        shared: dict[str, Parameter] = {}
        self.prefill_cells = {
            by_file[p.name][1]["length"]: self._load(p, shared, progress) for p in files.prefill_model
        }
        self.decode_cells = {
            (by_file[p.name][1]["rows"], by_file[p.name][1]["attend"]): self._load(p, shared, progress)
            for p in files.decode_model
        }
        self.argmax_cell = self._load(argmax_file(files), shared, progress)
        self.topk_cells = {by_file[p.name][1]["k"]: self._load(p, shared, progress) for p in files.topk_model}
        self.topk_buckets = sorted(self.topk_cells)
        _check_coverage(self, runtime, manifest_path)

    @staticmethod
    def _load(path: Path, shared: dict[str, Parameter], progress: Callable[[str], None]) -> nn.GraphCell:
        if not path.is_file():
            raise MindIRError(f"MindIR file {path} does not exist")
        try:
            cell = nn.GraphCell(ms.load(str(path)))
        except (RuntimeError, ValueError) as exc:
            raise MindIRError(f"{path}: cannot load as MindIR ({exc})") from exc
        for name, param in cell.parameters_dict().items():
            if name in shared:
                param.set_data(shared[name])  # one copy of each weight across the files
            else:
                shared[name] = param
        release_freed_memory()  # the files' discarded weight copies (measured: +780 MB, default model)
        progress(f"loaded {path.name}")
        return cell

    def prefill(
        self,
        table: np.ndarray,
        tokens: np.ndarray,
        length: int,
        start: int = 0,
        slot: int | None = None,
        every_row: bool = False,
        moves: StateMoves | None = None,
    ) -> Tensor:
        if every_row:  # exported with the last row's logits only
            raise ValueError("MindIR graphs compute no prompt logprobs (every row's logits)")
        inputs = as_tensors(self.inputs.prefill(table, tokens, length, start))
        return self.prefill_cells[length](*inputs, *self.caches)

    def decode(
        self,
        tables: np.ndarray,
        tokens: np.ndarray,
        positions: np.ndarray,
        rows: int,
        attend: int = 0,
        slots: Sequence[int] | None = None,
        moves: StateMoves | None = None,
    ) -> tuple[Tensor, Tensor]:
        inputs = as_tensors(self.inputs.decode(tables, tokens, positions, rows, attend))
        return self.decode_cells[(rows, attend)](*inputs, *self.caches)

    def argmax(self, logits: Tensor) -> Tensor:
        return self.argmax_cell(logits)

    def topk(self, k: int, logits: Tensor) -> tuple[Tensor, Tensor]:
        return self.topk_cells[k](logits)

    def cache_bytes(self) -> int:
        return sum(c.size * c.itemsize for c in self.caches)


def _check_runtime(exported: dict, configured: dict, manifest_path: Path) -> None:
    differences = [
        f"{name}: exported {exported.get(name)!r}, configured {value!r}"
        for name, value in configured.items()
        if exported.get(name) != value
    ]
    if differences:
        raise MindIRError(
            f"the runtime section does not match the shapes the MindIR graphs in "
            f"{manifest_path.parent} were exported with ({'; '.join(differences)}): "
            f"export again with this config, or change the config"
        )


def _check_coverage(graphs: MindIRGraphs, runtime: RuntimeSection, manifest_path: Path) -> None:
    missing = [f"prefill length {n}" for n in runtime.prefill_buckets if n not in graphs.prefill_cells]
    missing += [
        f"decode batch {b}" + (f" attend {a}" if a else "")
        for b in runtime.decode_batch_buckets
        for a in graphs.inputs.decode_attends
        if (b, a) not in graphs.decode_cells
    ]
    missing += [f"top-k {k}" for k in topk_buckets(graphs.spec.vocab_size) if k not in graphs.topk_cells]
    if missing:
        raise MindIRError(
            f"the configured MindIR files lack graphs for: {', '.join(missing)} "
            f"(all of them are in {manifest_path.parent}; list every file)"
        )
