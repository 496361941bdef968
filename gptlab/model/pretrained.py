"""model.init_from: a run that starts from existing weights (guide: docs/finetuning.md).

A source is GPT-2's published weights by name (the Hugging Face Hub, downloaded once into its
cache), a Hugging Face GPT-2 folder (``transformers``' save_pretrained, gptlab.export's hf_gpt2/),
a gptlab export folder, or a gptlab run folder or checkpoint. (An MLflow model URI is downloaded
by training/build.py, above the registry, and read here as the export folder it is.)

``hub_folder`` makes a name a local folder; ``read_source`` reads a source's shape and tokenizer
without its weights (a safetensors file's header is checked then); ``shaped`` puts that shape into
the run's model config, a contradicting command-line override being one line; ``source_state``
reads the weights under gptlab's names and ``load_into`` copies them into the built model, before
it is wrapped or sharded. Nothing runs code from a source: safetensors, or torch.load with
weights_only.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Dict, Optional

import torch

from gptlab.errors import GptlabError
from gptlab.model.config import GPTConfig, padded_vocab

# the published GPT-2 sizes, by the names nanoGPT and transformers use, and their Hub repositories
HUB = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}
GPT2_VOCAB = 50257
# transformers' activation names -> gptlab's MLP (gelu_new is GPT-2's tanh approximation)
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm default, which gptlab's model uses
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# transformers' GPT-2 Conv1D layers store (in, out): transposed into gptlab's nn.Linear
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
HF_BUFFERS = (".attn.bias", ".attn.masked_bias")  # old files' causal-mask buffers, not weights
WHAT = (
    "gpt2, gpt2-medium, gpt2-large, gpt2-xl, a Hugging Face GPT-2 folder, a gptlab export, run "
    "folder or checkpoint, or an MLflow model URI (models:/NAME@ALIAS, models:/NAME/VERSION, "
    "runs:/ID/model)"
)


@dataclass
class Source:
    """A source's shape and tokenizer, read without its weights."""

    spec: str  # model.init_from as given
    kind: str  # hf | export | checkpoint
    path: Path  # the folder (hf, export) or checkpoint file
    shape: Dict[str, Any]  # GPTConfig fields the source fixes (vocab_size: its embedding's rows)
    tokenizer_kind: Optional[str]  # the data.tokenizer.kind it needs, where it says
    tokenizer: Optional[Dict[str, Any]] = None  # gptlab's tokenizer meta (export, checkpoint)
    temporary: Optional[Path] = None  # a downloaded copy's folder, removed once loaded

    def fail(self, what: str) -> GptlabError:
        return GptlabError(f"model.init_from={self.spec}: {what}")


def hub_folder(name: str) -> Path:
    """GPT-2's published weights by name: the Hub's files in its cache (downloaded once).

    One line names the local-folder override when the Hub cannot be reached.
    """
    offline = (
        f"model.init_from={name}: the Hugging Face Hub cannot be reached and {name} is not in its "
        f"cache; download {HUB[name]} where it can be (config.json, model.safetensors) and name "
        "the folder: model.init_from=/path/to/folder"
    )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise GptlabError(offline + " (or pip install huggingface_hub)") from None
    try:
        return Path(snapshot_download(HUB[name], allow_patterns=["config.json", HF_WEIGHTS[0]]))
    except Exception:  # noqa: BLE001 - offline, DNS, HTTP: the same remedy
        raise GptlabError(offline) from None


def read_source(spec: str, path: Path) -> Source:
    """The shape and tokenizer of the source at `path` (a folder or file).

    Else one line saying what it is not.
    """
    if not path.exists():
        raise GptlabError(f"model.init_from={spec}: no such folder or file; it may be {WHAT}")
    meta = _json(spec, path / "config.json") if path.is_dir() else None
    if meta is not None and isinstance(meta.get("model"), dict) and "tokenizer" in meta:
        shape = _gptlab_shape(meta["model"])
        tok = meta["tokenizer"]
        return Source(spec, "export", path, shape, tok.get("kind"), tok)
    if meta is not None:
        return _hf_source(spec, path, meta)
    from gptlab.checkpoint import state as checkpoint

    try:
        found = checkpoint.find(str(path))
        saved = checkpoint.TrainingState.load(found)
    except GptlabError:
        raise GptlabError(
            f"model.init_from={spec}: neither a model folder (no config.json) nor a gptlab run "
            f"folder or checkpoint; it may be {WHAT}"
        ) from None
    tok = saved.tokenizer
    return Source(spec, "checkpoint", found, _gptlab_shape(saved.model_config), tok["kind"], tok)


def _json(spec: str, path: Path) -> Optional[Dict[str, Any]]:
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GptlabError(f"model.init_from={spec}: {path} does not read as JSON ({e})") from None
    if not isinstance(meta, dict):
        raise GptlabError(f"model.init_from={spec}: {path} is not a model config")
    return meta


def _gptlab_shape(model_config: Dict[str, Any]) -> Dict[str, Any]:
    """A gptlab model config's architecture.

    Everything but its name, dropout, padding and source.
    """
    keep = {f.name for f in dataclasses.fields(GPTConfig)}
    keep -= {"name", "dropout", "vocab_multiple", "init_from"}
    return {k: v for k, v in model_config.items() if k in keep}


def _hf_source(spec: str, folder: Path, c: Dict[str, Any]) -> Source:
    """A Hugging Face GPT-2 folder's shape.

    Every setting gptlab's model cannot reproduce is refused by name.
    """
    src = Source(spec, "hf", folder, {}, None)
    if c.get("model_type") != "gpt2":
        kind = c.get("model_type") or "unnamed"
        raise src.fail(f"a {kind} model (config.json's model_type); only GPT-2's loads (gpt2)")
    mlp = ACTIVATIONS.get(c.get("activation_function", "gelu_new"))
    unsupported = {
        "activation_function": mlp is None,
        "layer_norm_epsilon": c.get("layer_norm_epsilon", LAYER_NORM_EPS) != LAYER_NORM_EPS,
        "scale_attn_weights": not c.get("scale_attn_weights", True),
        "scale_attn_by_inverse_layer_idx": c.get("scale_attn_by_inverse_layer_idx", False),
    }
    for key, bad in unsupported.items():
        if bad:
            raise src.fail(f"config.json's {key}={c.get(key)} is not what gptlab's GPT computes")
    try:
        n_embd, vocab = int(c["n_embd"]), int(c["vocab_size"])
        src.shape = {
            "vocab_size": vocab,
            "block_size": int(c["n_positions"]),
            "n_layer": int(c["n_layer"]),
            "n_head": int(c["n_head"]),
            "n_embd": n_embd,
            "ffn_dim": None if c.get("n_inner") in (None, 4 * n_embd) else int(c["n_inner"]),
            "bias": True,
            "pos_emb": "learned",
            "mlp": mlp,
            "tie_weights": bool(c.get("tie_word_embeddings", True)),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise src.fail(f"config.json lacks a GPT-2 setting ({e})") from None
    gpt2_rows = vocab in (GPT2_VOCAB, padded_vocab(GPT2_VOCAB, 64))
    src.tokenizer_kind = c.get("gptlab_tokenizer") or ("gpt2" if gpt2_rows else None)
    _check_weights_file(src)
    return src


def _check_weights_file(src: Source) -> None:
    """Checks the weights file before anything is allocated.

    The file is there and, for safetensors, its header reads and its tensors fit the file (a
    truncated or corrupt file).
    """
    files = [src.path / name for name in HF_WEIGHTS if (src.path / name).is_file()]
    if not files:
        raise src.fail(f"no {' or '.join(HF_WEIGHTS)} in {src.path}")
    if files[0].suffix != ".safetensors":
        return
    try:
        from safetensors import safe_open

        with safe_open(str(files[0]), framework="pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # noqa: BLE001 - safetensors' errors name the damage
        raise src.fail(f"{files[0]} is not a readable safetensors file ({e})") from None
    wte = shapes.get("transformer.wte.weight", shapes.get("wte.weight"))
    if wte != [src.shape["vocab_size"], src.shape["n_embd"]]:
        raise src.fail(f"{files[0]}: its token embedding {wte} does not match config.json")


def check_tokenizer(source: Source, kind: str) -> None:
    """What the source says its tokenizer is, checked against data.tokenizer.kind.

    Before any data is prepared.
    """
    want = source.tokenizer_kind
    if want is not None and want != kind:
        raise GptlabError(
            f"model.init_from={source.spec} was trained on the {want} tokenizer: set "
            f"data.tokenizer.kind={want} (data.tokenizer.kind={kind} gives its ids other meanings)"
        )


def check_vocab(source: Source, tokenizer: Any, vocab: int) -> None:
    """The prepared data's tokenizer checked against the source's embedding.

    The same vocabulary (the source's rows may be it padded, as nanoGPT's 50,304 for GPT-2's
    50,257), and for a gptlab source the same tokens.
    """
    rows = source.shape["vocab_size"]
    if not vocab <= rows <= padded_vocab(vocab, 128):
        raise source.fail(
            f"its embedding has {rows:,} rows, the data's tokenizer {vocab:,} tokens: "
            "data.tokenizer must be the one the source was trained with"
        )
    if source.tokenizer is not None and source.tokenizer != tokenizer.to_meta():
        raise source.fail(
            f"its {source.tokenizer.get('kind')} tokenizer differs from the data's "
            "(another vocabulary or merges): data.tokenizer must be the one it was trained with"
        )


def shaped(m: GPTConfig, source: Source, explicit: Collection[str]) -> GPTConfig:
    """The run's model config with the source's shape.

    It replaces the model preset's shape keys; an explicit command-line override (`explicit`: the
    model keys given there) that disagrees is one line, but for block_size, which may crop the
    source's positions.
    """
    changes: Dict[str, Any] = {}
    for key, value in source.shape.items():
        ours = getattr(m, key)
        if key == "vocab_size":  # the tokenizer's, checked against the rows once data is prepared
            if ours is not None and not ours <= value <= padded_vocab(ours, 128):
                raise _contradicts(source, key, ours, value)
        elif key == "block_size" and key in explicit:
            if ours > value:
                raise _contradicts(source, key, ours, value, " (its positions end there)")
        elif key in explicit and ours != value:
            raise _contradicts(source, key, ours, value)
        else:
            changes[key] = value
    return dataclasses.replace(m, **changes)


def _contradicts(source: Source, key: str, ours: Any, value: Any, why: str = "") -> GptlabError:
    return GptlabError(
        f"model.{key}={ours} contradicts model.init_from={source.spec}, whose {key} is "
        f"{value}{why}: drop the override (the source's shape is the model's)"
    )


def source_state(source: Source) -> Dict[str, torch.Tensor]:
    """The source's weights under gptlab's names, on the CPU.

    A gptlab checkpoint's evaluated weights: its average where the run kept one.
    """
    if source.kind == "checkpoint":
        from gptlab.model.inference import load_model

        return load_model(str(source.path))[0].state_dict()
    if source.kind == "export":
        from safetensors.torch import load_file

        return load_file(str(source.path / "model.safetensors"))
    return _hf_state(source)


def _hf_state(source: Source) -> Dict[str, torch.Tensor]:
    """A Hugging Face GPT-2 folder's tensors renamed (and Conv1D's transposed) to gptlab's."""
    path = next(source.path / n for n in HF_WEIGHTS if (source.path / n).is_file())
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            raw = load_file(str(path))
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged file: its name and the reader's words
        raise source.fail(f"{path} does not read ({type(e).__name__}: {e})") from None
    out = {}
    for name, tensor in raw.items():
        name = name.removeprefix("transformer.")
        if name.endswith(HF_BUFFERS):
            continue
        out[name] = tensor.t() if name.endswith(CONV1D) else tensor
    return out


@torch.no_grad()
def load_into(model: torch.nn.Module, source: Source) -> None:
    """Copy the source's weights into the built model (before any wrapping or sharding).

    A padded embedding's extra rows are zeroed: never a token, so never sampled nor in the loss; a
    shorter block_size takes the first positions.
    """
    state, cfg = source_state(source), model.config
    V, T = cfg.vocab_size, cfg.block_size
    own = model.state_dict()  # tensors sharing the parameters' storage
    unknown = set(state) - set(own)
    if unknown:
        raise source.fail(f"weights gptlab's GPT does not have: {', '.join(sorted(unknown)[:3])}")
    for name, target in own.items():
        if name == "lm_head.weight" and cfg.tie_weights:
            continue  # the embedding
        if name not in state:
            raise source.fail(f"no weight {name} in {source.path}")
        value = state[name]
        if name in ("wte.weight", "lm_head.weight"):
            target[V:].zero_()
            target, value = target[:V], value[:V]
        elif name == "wpe.weight":
            value = value[:T]
        if tuple(value.shape) != tuple(target.shape):
            raise source.fail(f"{name} is {tuple(value.shape)}, the model's {tuple(target.shape)}")
        target.copy_(value)
