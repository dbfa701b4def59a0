"""A SentencePiece-BPE tokenizer rebuilt from a GGUF file's vocabulary, for the models transformers gets wrong.

llama.cpp stores a SentencePiece tokenizer as pieces, scores and token types. For a SentencePiece *BPE*
model (Gemma's) the score of a piece is minus its merge rank, but transformers' GGUF converter reads every
"llama"-type tokenizer as Unigram: on Gemma 3 it tokenizes "The capital" as ten single characters with no
<bos>, and the model it serves answers garbage. The merges can be recovered from the vocabulary the way
transformers' own SentencePieceExtractor recovers them from a .model file: every split of a piece into two
pieces of the vocabulary is a merge, ranked by the merged piece's score (ties by the pair's ids).

Runs in the quantize environment (gguf, tokenizers), called by convert_gguf.
"""

from __future__ import annotations

from pathlib import Path

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # llama.cpp token types


def needs_rebuild(gguf_file: Path) -> bool:
    """Gemma's tokenizers are SentencePiece BPE stored as scores (the families whose GGUF tokenizer
    transformers reads as Unigram)."""
    import gguf

    arch = _field(gguf.GGUFReader(gguf_file), "general.architecture")
    return isinstance(arch, str) and arch.startswith("gemma")


def _field(reader, key: str):
    import gguf

    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i][0].item() for i in f.data]
    return f.parts[f.data[0]][0].item()


def build(gguf_file: Path):
    """A `tokenizers.Tokenizer` equal in behaviour to the SentencePiece BPE model the GGUF was made from."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    r = gguf.GGUFReader(gguf_file)
    pieces, scores, types = (_field(r, f"tokenizer.ggml.{k}") for k in ("tokens", "scores", "token_type"))
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = []
    for piece, score, kind in zip(pieces, scores, types, strict=True):
        if kind != NORMAL:
            continue
        for k in range(1, len(piece)):
            a, b = vocab.get(piece[:k]), vocab.get(piece[k:])
            if a is not None and b is not None and types[a] == NORMAL and types[b] == NORMAL:
                merges.append((-score, a, b))
    merges.sort()
    unk = _field(r, "tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(pieces[a], pieces[b]) for _, a, b in merges],
                               unk_token=pieces[unk] if unk is not None else None, byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    # control tokens are special (dropped when decoding); user-defined ones (newline runs, tabs) are text
    tok.add_tokens([AddedToken(p, special=(t == CONTROL), normalized=False)
                    for p, t in zip(pieces, types, strict=True) if t in (CONTROL, USER_DEFINED)])
    bos = _field(r, "tokenizer.ggml.bos_token_id")
    if bos is not None and _field(r, "tokenizer.ggml.add_bos_token") is not False:  # llama.cpp's default: add it
        tok.post_processor = processors.TemplateProcessing(
            single=f"{pieces[bos]} $A", pair=f"{pieces[bos]} $A {pieces[bos]} $B", special_tokens=[(pieces[bos], bos)])
    return tok, {k: pieces[i] for k in ("bos", "eos", "unknown", "padding")
                 if (i := _field(r, f"tokenizer.ggml.{k}_token_id")) is not None}
