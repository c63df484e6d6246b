"""Export a trained checkpoint for serving: ``streamnmt export --format ctranslate2``.

Most people who deploy NMT models serve them with CTranslate2 (the OpenNMT project's inference
engine, which also serves fairseq and Marian models). This module writes a streamnmt checkpoint as
a CTranslate2 model directory through CTranslate2's own converter API, as its fairseq and
OpenNMT converters do: a :class:`ctranslate2.converters.Converter` whose ``_load()`` fills a
:class:`ctranslate2.specs.TransformerSpec` with the checkpoint's tensors. The directory also gets
the two SentencePiece models (``source.model``, ``target.model``), so it is all a server needs.

How streamnmt's model maps onto the spec: pre-norm layers with a final LayerNorm on each side,
ReLU feed-forward, embeddings scaled by sqrt(d_model), sinusoidal positions written out as a table
(streamnmt interleaves sin/cos per dimension, CTranslate2's built-in table does not), separate
source and target vocabularies listed by id (the SentencePiece pieces), LayerNorm epsilon 1e-5,
self-attention Q/K/V fused in that order (streamnmt keeps Q and a fused K/V), the decoder started
with BOS and the source ended with EOS as the training batches are. A generator tied to the target
embedding is exported as the same tensor under both names.

``ctranslate2`` is an optional dependency (``pip install 'streamnmt[deploy]'``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamnmt.models import masks
from streamnmt.configbase import check, check_choice, opt
from streamnmt.data import Tokenizer
from streamnmt.errors import ConfigError, InputError
from streamnmt.models.transformer import Transformer
from streamnmt.inference.translate import load_for_inference

FORMATS = ("ctranslate2",)
QUANTIZATIONS = ("none", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16",
                 "bfloat16", "float32")
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which the model uses


@dataclass(kw_only=True)
class ExportConfig:
    weights: str | None = opt(None, "checkpoint written by streamnmt train, e.g. runs/train/exp/weights/best.pt "
                                    "(required)")
    format: str = opt("ctranslate2", "export format", choices=FORMATS)
    out: str | None = opt(None, "output directory, e.g. runs/export/ct2 (required)")
    quantization: str = opt("none", "CTranslate2 weight type; none keeps float32 (what translate computes)",
                            choices=QUANTIZATIONS)
    force: bool = opt(False, "replace --out if it exists")
    tokenizer_src: str | None = opt(None, "source SentencePiece model; none = the one embedded in the checkpoint "
                                          "(older checkpoints: the file it names)")
    tokenizer_tgt: str | None = opt(None, "target SentencePiece model; none = the one embedded in the checkpoint "
                                          "(older checkpoints: the file it names)")

    def __post_init__(self) -> None:
        check(bool(self.weights), "weights", "is required: the checkpoint to export, "
                                             "e.g. --weights runs/train/exp/weights/best.pt")
        check(bool(self.out), "out", "is required: the directory to write, e.g. --out runs/export/ct2")
        check_choice(self.format, "format", FORMATS)
        check_choice(self.quantization, "quantization", QUANTIZATIONS)


def import_ctranslate2() -> Any:
    try:
        import ctranslate2
    except ImportError:
        raise ConfigError("--format ctranslate2 needs the ctranslate2 package: "
                          "pip install 'streamnmt[deploy]' (or pip install ctranslate2)") from None
    return ctranslate2


# -- the converter ---------------------------------------------------------------------------------


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).contiguous().numpy()


def make_converter(model: Transformer, src_tok: Tokenizer, tgt_tok: Tokenizer) -> Any:
    """A ``ctranslate2.converters.Converter`` for ``model`` (its ``convert(dir)`` writes the model)."""
    import_ctranslate2()
    from ctranslate2.converters.converter import Converter

    class StreamnmtConverter(Converter):
        def _load(self) -> Any:
            return build_spec(model, src_tok, tgt_tok)

    return StreamnmtConverter()


def build_spec(model: Transformer, src_tok: Tokenizer, tgt_tok: Tokenizer) -> Any:
    """A filled ``ctranslate2.specs.TransformerSpec`` of ``model`` and its vocabularies."""
    import_ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    s = model.shape
    sd = model.state_dict()  # tied weights appear under each name
    spec = transformer_spec.TransformerSpec.from_config(
        (s.n_layers, s.n_layers), s.n_heads, pre_norm=True, activation=common_spec.Activation.RELU)
    pe = _np(model.pos.pe)  # (max_positions, D), row = position

    def linear(dst: Any, name: str) -> None:
        dst.weight = _np(sd[f"{name}.weight"])
        if f"{name}.bias" in sd:
            dst.bias = _np(sd[f"{name}.bias"])

    def norm(dst: Any, name: str) -> None:
        dst.gamma, dst.beta = _np(sd[f"{name}.weight"]), _np(sd[f"{name}.bias"])

    def fused_qkv(dst: Any, name: str) -> None:  # CTranslate2: one (q, k, v) matrix, as streamnmt's qkv
        if f"{name}.qkv.weight" in sd:
            dst.weight, dst.bias = _np(sd[f"{name}.qkv.weight"]), _np(sd[f"{name}.qkv.bias"])
            return
        dst.weight = np.concatenate([_np(sd[f"{name}.q.weight"]), _np(sd[f"{name}.kv.weight"])])
        dst.bias = np.concatenate([_np(sd[f"{name}.q.bias"]), _np(sd[f"{name}.kv.bias"])])

    # encoder
    enc = spec.encoder
    enc.embeddings[0].weight = _np(sd["src_embed.weight"])
    enc.scale_embeddings = True  # by sqrt(d_model), as model.scale
    enc.position_encodings.encodings = pe
    for i, layer in enumerate(enc.layer):
        p = f"encoder.{i}"
        fused_qkv(layer.self_attention.linear[0], f"{p}.attn")
        linear(layer.self_attention.linear[1], f"{p}.attn.out")
        norm(layer.self_attention.layer_norm, f"{p}.ln1")
        norm(layer.ffn.layer_norm, f"{p}.ln2")
        linear(layer.ffn.linear_0, f"{p}.ff.w1")
        linear(layer.ffn.linear_1, f"{p}.ff.w2")
    norm(enc.layer_norm, "enc_norm")

    # decoder
    dec = spec.decoder
    dec.embeddings.weight = _np(sd["tgt_embed.weight"])
    dec.scale_embeddings = True
    dec.position_encodings.encodings = pe
    for i, layer in enumerate(dec.layer):
        p = f"decoder.{i}"
        fused_qkv(layer.self_attention.linear[0], f"{p}.self_attn")
        linear(layer.self_attention.linear[1], f"{p}.self_attn.out")
        norm(layer.self_attention.layer_norm, f"{p}.ln1")
        linear(layer.attention.linear[0], f"{p}.cross_attn.q")
        linear(layer.attention.linear[1], f"{p}.cross_attn.kv")  # (k, v) fused, as CTranslate2 wants
        linear(layer.attention.linear[2], f"{p}.cross_attn.out")
        norm(layer.attention.layer_norm, f"{p}.ln2")
        norm(layer.ffn.layer_norm, f"{p}.ln3")
        linear(layer.ffn.linear_0, f"{p}.ff.w1")
        linear(layer.ffn.linear_1, f"{p}.ff.w2")
    norm(dec.layer_norm, "dec_norm")
    # The output projection; a generator tied to the target embedding may hold no weight of its own.
    dec.projection.weight = _np(sd.get("generator.weight", sd["tgt_embed.weight"]))
    if "generator.bias" in sd:
        dec.projection.bias = _np(sd["generator.bias"])

    # vocabularies (pieces by id) and special tokens (ids fixed by masks.py)
    spec.register_source_vocabulary([src_tok.piece(i) for i in range(src_tok.vocab_size)])
    spec.register_target_vocabulary([tgt_tok.piece(i) for i in range(tgt_tok.vocab_size)])
    cfg = spec.config
    cfg.unk_token, cfg.bos_token, cfg.eos_token = (tgt_tok.piece(masks.UNK), tgt_tok.piece(masks.BOS),
                                                   tgt_tok.piece(masks.EOS))
    cfg.decoder_start_token = tgt_tok.piece(masks.BOS)
    cfg.add_source_eos = True  # encoder input is tokens then EOS, as in training
    cfg.layer_norm_epsilon = LAYER_NORM_EPS
    return spec


# -- the command -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _staged_dir(out: Path, force: bool):
    """Yield an empty temporary directory beside ``out``; on success it becomes ``out`` (an old
    ``out`` is replaced only then), on failure it is removed and ``out`` is left as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; give the directory the usual permissions
    try:
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_ctranslate2(model: Transformer, src_tok: Tokenizer, tgt_tok: Tokenizer, out: str | Path, *,
                       quantization: str = "none", force: bool = False) -> Path:
    """Write ``model`` as a CTranslate2 model directory ``out`` with ``source.model`` and
    ``target.model`` beside it; returns ``out``."""
    out = Path(out)
    if out.exists() and not force:
        raise ConfigError(f"--out: {out} exists; pass --force to replace it")
    converter = make_converter(model, src_tok, tgt_tok)
    with _staged_dir(out, force) as tmp:
        model_dir = tmp / "model"  # the converter insists on creating its directory itself
        converter.convert(str(model_dir), quantization=None if quantization == "none" else quantization)
        for f in model_dir.iterdir():
            os.replace(f, tmp / f.name)
        model_dir.rmdir()
        (tmp / "source.model").write_bytes(src_tok.model_bytes())  # the model may exist only in the checkpoint
        (tmp / "target.model").write_bytes(tgt_tok.model_bytes())
    return out


def run_export(cfg: ExportConfig) -> int:
    """``streamnmt export``. Returns the exit code."""
    import_ctranslate2()  # before the checkpoint is read: a missing package is the first thing to say
    out = Path(cfg.out)
    if out.exists() and not cfg.force:
        raise ConfigError(f"--out: {out} exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out} is a file, not a directory")
    model, src_tok, tgt_tok, _ = load_for_inference(cfg.weights, "cpu", cfg.tokenizer_src, cfg.tokenizer_tgt)
    try:
        export_ctranslate2(model, src_tok, tgt_tok, out, quantization=cfg.quantization, force=cfg.force)
    except (ValueError, RuntimeError, NotImplementedError) as e:  # the converter's own checks
        raise InputError(f"--weights: {cfg.weights}: cannot export to CTranslate2 ({e})") from None
    print(f"exported {cfg.weights} to {out} (CTranslate2, {cfg.quantization if cfg.quantization != 'none' else 'float32'}"
          f"; source.model and target.model beside it)")
    return 0
