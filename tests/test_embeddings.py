"""Prompt embeddings: `embedding:NAME` splices a safetensors file's rows into Qwen3-VL's input embeddings.

Oracle: a hand-built `inputs_embeds` (the tokens before, the file's rows, the tokens after, each run of text
tokenized on its own) through the same real (tiny, random) Qwen3-VL. Tolerance: exact equality for the input (the
same lookups and copies) and for the hidden state (the same forward on the same input, fp32 on the CPU).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from h3_spark.cli import main
from h3_spark.errors import InputError
from h3_spark.h3_model.dit.config import TEXT_TAG
from h3_spark.h3_model.text.embeddings import (EmbeddingLibrary, EmbeddingRef, names_in, split_prompt,
                                               write_embedding)


@pytest.fixture(scope="module")
def encoder(tiny_t2va_engine):
    """The session's tiny synthetic Qwen3-VL (transformers' class, random weights, fp32 on the CPU)."""
    return tiny_t2va_engine.components.text_encoder


@pytest.fixture
def folder(tmp_path, encoder):
    write_embedding(tmp_path / "style.safetensors", encoder.hidden_size, rows=3, seed=1)
    write_embedding(tmp_path / "mood.safetensors", encoder.hidden_size, rows=1, seed=2, key="qwen3vl_32b")
    return tmp_path


def _tokens(encoder, text: str) -> list[int]:
    return encoder.tokenizer(text, add_special_tokens=False)["input_ids"]


def _last_layer(encoder, **inputs) -> torch.Tensor:
    out = []
    handle = encoder.model.language_model.layers[-1].register_forward_hook(
        lambda m, a, o: out.append(o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            encoder.model(use_cache=False, **inputs)
    finally:
        handle.remove()
    return out[-1]


# ------------------------------------------------------------------------------------------ the syntax
@pytest.mark.parametrize("prompt, parts", [
    ("a red embedding:style kite", ["a red", EmbeddingRef("style"), "kite"]),
    ("embedding:style a kite", [EmbeddingRef("style"), "a kite"]),
    ("a kite\nembedding:style.safetensors, at dusk", ["a kite", EmbeddingRef("style.safetensors"), ", at dusk"]),
    ("a kite embedding:style", ["a kite", EmbeddingRef("style")]),
    ("two embedding:style embedding:mood", ["two", EmbeddingRef("style"), EmbeddingRef("mood")]),
    ("no-embedding:here and word:embedding", ["no-embedding:here and word:embedding"]),  # not after a space
])
def test_the_prompt_splits_as_comfyui_reads_it(prompt, parts):
    assert split_prompt(prompt) == parts


# ------------------------------------------------------------------------------------------ the splice
def test_the_spliced_input_is_the_hand_built_one_and_so_are_the_hidden_states(encoder, folder):
    from safetensors import safe_open

    with safe_open(str(folder / "style.safetensors"), "pt") as f:
        style = f.get_tensor("emb_params")
    encoder.prompts.embeddings = EmbeddingLibrary([folder])
    try:
        p = encoder.prompts.t2va("a red embedding:style, kite")
        captured = []
        handle = encoder.model.language_model.register_forward_pre_hook(
            lambda m, args, kwargs: captured.append(kwargs["inputs_embeds"]), with_kwargs=True)
        try:
            got = encoder.encode(p).embeds
        finally:
            handle.remove()
    finally:
        encoder.prompts.embeddings = None
    embed = encoder.model.get_input_embeddings()
    before, after = _tokens(encoder, "a red"), _tokens(encoder, ", kite")
    with torch.no_grad():
        hand = torch.cat([embed(torch.tensor(before)), style, embed(torch.tensor(after))])[None]
    assert p.token_ids.numel() == len(before) + 3 + len(after) and p.spliced[0][0] == len(before)
    assert (p.tags == TEXT_TAG).all()  # embedding rows are text for the DiT, as ComfyUI tags them
    assert torch.equal(captured[0], hand)
    assert torch.equal(got, _last_layer(encoder, inputs_embeds=hand, attention_mask=torch.ones(hand.shape[:2])))
    # The rows make the difference: the placeholder ids alone encode to something else.
    assert not torch.allclose(got, _last_layer(encoder, input_ids=p.token_ids[None],
                                               attention_mask=torch.ones_like(p.token_ids[None])))


def test_another_file_under_the_same_name_is_encoded_anew(encoder, folder, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    write_embedding(other / "style.safetensors", encoder.hidden_size, rows=3, seed=9)
    hashes = []
    for where in (folder, other):
        encoder.prompts.embeddings = EmbeddingLibrary([where])
        try:
            hashes.append(encoder.prompts.t2va("a embedding:style kite").token_hash)
        finally:
            encoder.prompts.embeddings = None
    assert hashes[0] != hashes[1]  # the prompt cache keys on the rows, not the name


def test_comfyuis_keys_and_a_single_vector(encoder, folder):
    width = encoder.hidden_size
    g = torch.Generator().manual_seed(4)
    save_file({"string_to_param.*": torch.randn(2, width, generator=g), "name": torch.zeros(1)},
              str(folder / "ti.safetensors"))
    save_file({"only": torch.randn(width, generator=g)}, str(folder / "one.safetensors"))
    library = EmbeddingLibrary([folder])
    assert [(f.key, f.rows) for f in library.check_prompt("embedding:ti embedding:one embedding:mood x", width)] == \
        [("string_to_param.*", 2), ("only", 1), ("qwen3vl_32b", 1)]
    assert library.rows("one", width).shape == (1, width)


# ------------------------------------------------------------------------------------------ refusals
def _bad_files(folder, width):
    g = torch.Generator().manual_seed(5)
    save_file({"emb_params": torch.randn(2, width + 1, generator=g)}, str(folder / "wide.safetensors"))
    save_file({"emb_params": torch.randn(2, 2, width, generator=g)}, str(folder / "cube.safetensors"))
    save_file({"a": torch.randn(2, width, generator=g), "b": torch.randn(2, width, generator=g)},
              str(folder / "two.safetensors"))
    save_file({"emb_params": torch.ones(2, width, dtype=torch.int32)}, str(folder / "ints.safetensors"))
    save_file({"emb_params": torch.full((1, width), float("nan"))}, str(folder / "nan.safetensors"))
    (folder / "old.pt").write_bytes(b"\x80\x04not really a pickle")  # never opened: the name is enough
    (folder / "broken.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{\"a\"")


@pytest.mark.parametrize("name, message", [
    ("nope", "embedding:nope: no nope.safetensors in the embeddings folder"),
    ("old", "embedding:old: {d}/old.pt is a pickle file (.pt), which h3-spark does not open; convert it to "
            ".safetensors"),
    ("old.pt", "embedding:old.pt: {d}/old.pt is a pickle file (.pt), which h3-spark does not open"),
    ("wide", "embedding:wide: {d}/wide.safetensors is {w1} wide, but the text encoder's hidden size is {w}: it was "
             "made for another text encoder"),
    ("cube", "embedding:cube: {d}/cube.safetensors tensor 'emb_params' has shape [2, 2, {w}]; an embedding is "
             "(width,) or (rows, width)"),
    ("two", "embedding:two: {d}/two.safetensors holds 2 tensors (a, b) and none under a key an embedding is read "
            "from"),
    ("ints", "embedding:ints: {d}/ints.safetensors tensor 'emb_params' is I32; an embedding is floating point"),
    ("broken", "embedding:broken: {d}/broken.safetensors"),
    ("../escape", "embedding:../escape: the name leaves the embeddings folder {d}"),
])
def test_bad_embeddings_are_refused_in_one_line_naming_them(encoder, tmp_path, name, message):
    width = encoder.hidden_size
    _bad_files(tmp_path, width)
    library = EmbeddingLibrary([tmp_path])
    with pytest.raises(InputError) as err:
        library.check_prompt(f"a kite embedding:{name} at dusk", width)
    text = str(err.value)
    assert message.format(d=tmp_path, w=width, w1=width + 1) in text and "\n" not in text


def test_nan_rows_and_a_prompt_without_a_folder_are_refused(encoder, tmp_path):
    _bad_files(tmp_path, encoder.hidden_size)
    with pytest.raises(InputError, match="embedding:nan: .* holds NaN or infinite values"):
        EmbeddingLibrary([tmp_path]).rows("nan", encoder.hidden_size)
    with pytest.raises(InputError, match="the prompt names embedding:style but no embeddings folder is given"):
        encoder.prompts.t2va("a embedding:style kite")
    with pytest.raises(InputError, match="embeddings folder .*missing: no such folder"):
        EmbeddingLibrary([tmp_path / "missing"])
    with pytest.raises(InputError, match="writes 'embedding:' without a name"):
        names_in("a embedding: kite")


# ------------------------------------------------------------------------------------------ the doors
@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch):
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")


def test_make_checkpoint_writes_an_embedding_the_demo_reads(demo_models, tmp_path, capsys):
    emb = tmp_path / "emb"
    emb.mkdir()
    assert main(["make-checkpoint", str(emb / "style.safetensors"), "--component", "embedding", "--seed", "3"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["width"] == 32 and made["rows"] == 2
    out = tmp_path / "still.png"
    code = main(["generate", "--demo-dir", str(demo_models), "--image", "--steps", "2", "--width", "64", "--height",
                 "64", "--prompt", "a kite embedding:style at dusk", "--embeddings", str(emb), "--out", str(out)])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    assert out.is_file()


@pytest.mark.parametrize("prompt, extra, message", [
    ("a embedding:style kite", [], "the prompt names embedding:style but no embeddings folder is given"),
    ("a embedding:wide kite", ["--embeddings", "{d}"], "embedding:wide: {d}/wide.safetensors is 33 wide, but the "
                                                       "text encoder's hidden size is 32"),
    ("a embedding:gone kite", ["--embeddings", "{d}"], "embedding:gone: no gone.safetensors"),
])
def test_the_cli_refuses_bad_embeddings_before_any_weight_loads(demo_models, tmp_path, capsys, monkeypatch, prompt,
                                                                extra, message):
    _bad_files(tmp_path, 32)
    loads = []
    monkeypatch.setattr("h3_spark.h3_model.engine.engine.Engine.load", lambda *a, **k: loads.append(a))
    code = main(["generate", "--demo-dir", str(demo_models), "--image", "--prompt", prompt,
                 *[e.format(d=tmp_path) for e in extra], "--out", str(tmp_path / "o.png")])
    err = capsys.readouterr().err
    assert code == 2 and message.format(d=tmp_path) in err and len(err.strip().splitlines()) == 1
    assert loads == []


def test_the_node_reads_comfyuis_embeddings_folder(monkeypatch, tmp_path, encoder):
    from h3_spark.nodes import engine as node_engine
    from h3_spark.nodes import host

    folder = tmp_path / "models" / "embeddings"
    folder.mkdir(parents=True)
    write_embedding(folder / "minimaxh3_style.safetensors", encoder.hidden_size, rows=2, seed=6)
    monkeypatch.setattr(host, "embedding_folders", lambda: [folder])
    handle = node_engine.TextEncoderHandle(encoder, None)
    monkeypatch.setattr(handle, "ready", lambda: encoder)
    try:
        embeds, tags = node_engine._text(handle, "t2va", "a kite embedding:minimaxh3_style at dusk")
        encoder.prompts.embeddings = EmbeddingLibrary([folder])
        want = encoder.encode(encoder.prompts.t2va("a kite embedding:minimaxh3_style at dusk")).embeds
    finally:
        encoder.prompts.embeddings = None
    assert torch.equal(embeds, want.cpu()) and tags.numel() == embeds.shape[1]
    monkeypatch.setattr(host, "embedding_folders", lambda: [])
    with pytest.raises(InputError, match="no embeddings folder is given"):
        node_engine._text(handle, "t2va", "a kite embedding:minimaxh3_style")


@pytest.mark.parametrize("extra", [{}, {"shots": [{"seconds": 6, "prompt": "then embedding:style rain"}]}])
def test_the_service_refuses_a_prompt_naming_an_embedding_at_submission(extra):
    from h3_spark.serve.validation import Limits, RequestError, parse_request

    body = {"prompt": "a kite", "output": "a.mp4", **extra} if extra else {"prompt": "a embedding:style kite",
                                                                            "output": "a.mp4"}
    with pytest.raises(RequestError) as err:
        parse_request(body, Limits())
    assert err.value.status == 400 and "no embeddings folder is given" in str(err.value) \
        and "the service takes no embeddings folder" in str(err.value)
