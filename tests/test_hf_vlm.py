"""The transformers integration on vision-language models: Qwen2-VL, Qwen2.5-VL, Qwen3-VL
(mRoPE positions, Qwen3-VL's deepstack), Llava (CLIP tower, Llama text model) and Mistral3
(Pixtral tower, Mistral text model).

Each family: a tiny random float64 model from its transformers config, trained one step
through the documented path (``multimodal_inputs`` -> ``shard_batch`` -> ``model``) on 4 gloo
ranks and on 2-rank pairs (one spawn), against the model run in one process on the same
global batch with its pixel values: the loss, every parameter gradient (the vision tower's
included) and the gathered logits; uneven and padded shards; for the Qwen families also with
the tower split over the ranks (``vision="split"``). Images sit across shard boundaries (the
17-token rows split 5/4/4/4 and 9/8). The text model's head counts (6/2) differ from the
vision tower's (4) and the top-level config has none; every attention call is checked to
plan 6/2. Also: packed multimodal documents (``cu_seqlens``, and the 4-row mRoPE form whose
text row restarts) against each document run alone, mRoPE rows that jump back inside an
image never read as documents, a Qwen2-VL video, ``sync_gradients`` with gradients missing
on some ranks, and the errors (Gemma 3's two-way image attention refused).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import close  # noqa: E402
from test_hf import reference as text_reference  # noqa: E402

from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402

VOCAB = 64
IMAGE = 60  # the image placeholder token of every family here
SEQ = 17  # shards 5/4/4/4 (4 ranks), 9/8 (2 ranks)
# Each image is 4 tokens. Row 0: images at 3..6 (crosses 5 | 6) and 11..14 (crosses 13 | 14);
# row 1: one at 7..10 (crosses 9 | 10 at 2 and 4 ranks).
IMAGES = [(0, 3), (0, 11), (1, 7)]
TEXT = {  # the text model: 6 query heads over 2 KV heads (do not divide 4), head_dim 16
    "vocab_size": VOCAB, "hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 6,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0,
}  # fmt: skip
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # sums to head_dim / 2
# The vision towers: 4 heads (not the text model's 6), 2 layers; 16 patches per image merged 2x2 into 4 tokens.
QWEN_VISION = {"depth": 2, "num_heads": 4, "patch_size": 2, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3}


def _qwen(family: str):
    if family == "qwen2_vl":
        return transformers.Qwen2VLForConditionalGeneration(transformers.Qwen2VLConfig(
            text_config={**TEXT, "rope_parameters": MROPE}, vision_config={**QWEN_VISION, "embed_dim": 32, "hidden_size": 96},
            image_token_id=IMAGE, video_token_id=59, vision_start_token_id=58, vision_end_token_id=57, attn_implementation="sdpa",
        ))  # fmt: skip
    if family == "qwen2_5_vl":
        return transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
            text_config={**TEXT, "rope_parameters": MROPE},
            vision_config={**QWEN_VISION, "hidden_size": 32, "intermediate_size": 48, "out_hidden_size": 96, "window_size": 4,
                           "fullatt_block_indexes": [1]},
            image_token_id=IMAGE, video_token_id=59, vision_start_token_id=58, vision_end_token_id=57, attn_implementation="sdpa",
        ))  # fmt: skip
    return transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(
        text_config={**TEXT, "rope_parameters": {**MROPE, "mrope_interleaved": True}},
        vision_config={**QWEN_VISION, "hidden_size": 32, "intermediate_size": 48, "out_hidden_size": 96, "num_position_embeddings": 16,
                       "deepstack_visual_indexes": [0, 1]},
        image_token_id=IMAGE, video_token_id=59, vision_start_token_id=58, vision_end_token_id=57, attn_implementation="sdpa",
    ))  # fmt: skip


def _llava():
    return transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        text_config={**TEXT, "model_type": "llama"},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "image_size": 8, "patch_size": 4, "projection_dim": 32},
        image_token_id=IMAGE, image_seq_length=4, vision_feature_layer=-1, attn_implementation="sdpa",
    ))  # fmt: skip


def _mistral3():
    # Pixtral tower: 8 x 8 images in 2 x 2 patches (16), merged 2 x 2 into 4 tokens.
    return transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config={**TEXT, "model_type": "mistral"},
        vision_config={"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "head_dim": 8, "image_size": 8, "patch_size": 2},
        image_token_index=IMAGE, spatial_merge_size=2, attn_implementation="sdpa",
    ))  # fmt: skip


FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "mistral3"]
PIXELS_4D = {"llava", "mistral3"}  # pixel_values [images, 3, 8, 8]; the Qwen families take patch rows
SPLIT = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"}  # multimodal_inputs(vision="split"): towers that take image_grid_thw


def build(family: str):
    torch.manual_seed(0)
    model = {"llava": _llava, "mistral3": _mistral3}.get(family, lambda: _qwen(family))()
    return model.double()


def global_batch(family: str, images=IMAGES, rows: int = 2, seq: int = SEQ):
    """``(input_ids [rows, seq], labels, vision inputs)``: random text, 4 placeholder tokens
    per image, pixel values drawn at random (labels -100 on the placeholders and a prompt)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 56, (rows, seq), generator=g)
    for r, start in images:
        ids[r, start : start + 4] = IMAGE
    labels = ids.masked_fill(ids == IMAGE, -100)
    labels[0, :2] = -100
    n = len(images)
    if family in PIXELS_4D:
        vision = {"pixel_values": torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64)}
        if family == "mistral3":
            vision["image_sizes"] = torch.tensor([[8, 8]] * n)
    else:  # 16 patches of 3 x 2 x 2 x 2 values per image, a 1 x 4 x 4 grid
        vision = {"pixel_values": torch.randn(16 * n, 24, generator=g, dtype=torch.float64),
                  "image_grid_thw": torch.tensor([[1, 4, 4]] * n), "mm_token_type_ids": (ids == IMAGE).int()}  # fmt: skip
    return ids, labels, vision


def reference(model, ids, labels, vision):
    """One process, the model's own forward with its pixel values: loss, grads, logits, and
    transformers' own loss (``test_hf.reference``)."""
    return text_reference(model, ids, labels, **vision)


# Vision towers that compute in float32 whatever the model dtype: the Qwen towers apply their
# rotary embedding in float32 (``apply_rotary_pos_emb_vision`` calls ``q.float()``,
# ``k.float()``), Pixtral's and Mistral3's projector RMSNorms normalise in float32. The
# gradients of those towers' parameters are then sums of float32-rounded terms: the sharded
# sum of the ranks' shares and the one-process sum agree to float32 rounding, not float64's.
# Everything else (every text model, Llava's CLIP tower) computes in float64.
# NOTE: measured at 2 and 4 ranks, plain and packed: vision-tower gradients up to 8.9e-10
# (Qwen2-VL), 9.7e-9 (Qwen2.5-VL), 1.3e-9 (Qwen3-VL), 9.3e-8 (Mistral3), 6.5e-16 (Llava);
# text-model gradients at most 8e-16, loss 2e-16, logits 0.
FLOAT32_VISION = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "mistral3"}


def grad_tolerance(family: str, name: str) -> float:
    vision = name.startswith(("model.visual.", "model.vision_tower.", "model.multi_modal_projector."))
    return 2e-6 if vision and family in FLOAT32_VISION else 1e-9


def close_grad(grad, ref, rtol, what):
    """``close`` for a gradient; one that is zero in exact arithmetic (a key projection's bias:
    adding the same amount to every score of a query leaves its softmax unchanged) is
    rounding noise (~1e-19 here) in both runs, so both are checked to be negligible instead."""
    if ref.abs().max() < 1e-15:
        assert grad.abs().max() < 1e-15, f"{what}: {grad.abs().max().item():.3e} where one process has {ref.abs().max().item():.3e}"
        return
    close(grad, ref, rtol, what)


def sharded_step(model, family, ids, labels, vision, group, what, refs, pad=False, split=False):
    """The documented path, one step: multimodal_inputs -> shard_batch -> model, then the
    loss, every gradient (vision tower included) and the logits against ``refs``."""
    ref_loss, ref_grads, ref_logits, ref_hf_loss = refs
    rtol = 1e-12
    mm = hf.multimodal_inputs(model, ids, vision="split" if split else "replicated", group=group, **vision)
    assert set(mm) == {"inputs_embeds"} | ({"position_ids"} if family not in PIXELS_4D else set()) | (
        {"visual_pos_masks", "deepstack_visual_embeds"} if family == "qwen3_vl" else set()
    ), (what, sorted(mm))
    batch = hf.shard_batch(ids, labels, group=group, pad=pad, **mm)
    if "position_ids" in mm and mm["position_ids"].shape[0] == 3:
        # The t/h/w rows jump back inside an image (what verl PR #7137 misread as documents) ...
        assert bool((mm["position_ids"].diff(dim=-1) < 0).any()), what
        # ... and stay one sequence per row here.
        assert batch.shard.documents is None, what
    out = model(**batch.model_inputs(loss=False))
    # The attention calls planned the text model's heads (6 query, 2 KV), not the tower's 4.
    assert {(sig[1][2], sig[2][2]) for sig in batch.shard._checked} == {(6, 2)}, (what, batch.shard._checked)
    loss = batch.loss(out.logits)
    loss.backward()
    hf.sync_gradients(model, group)
    close(hf.reduce_loss(loss, group), ref_loss, rtol, f"{what}: loss")
    names = {n for n, p in model.named_parameters() if p.grad is not None}
    assert names == set(ref_grads), f"{what}: gradients of {sorted(names ^ set(ref_grads))} differ in presence"
    assert any(".visual." in n or "vision_tower" in n for n in names), f"{what}: no vision-tower gradient"
    for name, p in model.named_parameters():
        if p.grad is not None:
            close_grad(p.grad, ref_grads[name], grad_tolerance(family, name), f"{what}: grad of {name}")
    model.zero_grad(set_to_none=True)
    close(hf.gather_sequence(out.logits, batch.shard, group), ref_logits, rtol, f"{what}: logits")
    with torch.no_grad():
        hf_loss = hf.reduce_loss(model(**batch.model_inputs()).loss, group)
    close(hf_loss.double(), ref_hf_loss.double(), 1e-6, f"{what}: transformers loss")
    return batch


def check_families(group):
    import torch.distributed as dist

    world = dist.get_world_size(group) if group is not None or dist.is_initialized() else 1
    for family in FAMILIES:
        ids, labels, vision = global_batch(family)
        refs = reference(build(family), ids, labels, vision)
        model = hf.apply(build(family), group)
        # Only the text model was switched; the vision tower keeps its own (bidirectional) attention.
        text = model.config.get_text_config()
        assert text._attn_implementation == "ulysses" and model.config.vision_config._attn_implementation == "sdpa"
        assert not hasattr(model.config, "num_attention_heads") or model.config.num_attention_heads != 6  # heads: the text config's
        switched = [m for m in model.modules() if hasattr(m, "_ulysses_settings")]
        assert len(switched) == text.num_hidden_layers and all(m.config is text for m in switched), family
        for pad in (False, True):  # uneven shards (5/4/4/4, 9/8), or padded to 5 x 4, 9 x 2 (embeddings 0, positions continuing)
            sharded_step(model, family, ids, labels, vision, group, f"{family}, world {world}, pad={pad}", refs, pad)
        if family in SPLIT:  # each rank encodes some of the 3 images (4 ranks: one has none)
            sharded_step(model, family, ids, labels, vision, group, f"{family}, world {world}, vision split", refs, split=True)


# Packed documents (batch 1): [0, 14) with images at 5..8 and 10..13, [14, 16) text only, [16, 25)
# with an image at 18..21; shards 7/6/6/6 (4 ranks) and 13/12 (2 ranks), so images cross 7, 13 and 19.
DOCS = [0, 14, 16, 25]
PACKED_IMAGES = [(0, 5), (0, 10), (0, 18)]


def packed_positions(model, family, ids, vision):
    """A packed batch's positions, as a collator that packs processed samples makes them:
    each document's own (Qwen: its mRoPE positions from ``get_rope_index`` over the document
    alone, after a text row 0, 1, ... : the 4-row form transformers takes for packed inputs;
    Llava: 0, 1, ... per document)."""
    rows = []
    image = 0
    for a, b in zip(DOCS[:-1], DOCS[1:]):
        n = int((ids[0, a:b] == IMAGE).sum()) // 4
        text = torch.arange(b - a).view(1, 1, -1)
        if family in PIXELS_4D:
            rows.append(text[0])
        elif n == 0:
            rows.append(text.expand(4, 1, -1))
        else:
            grids = vision["image_grid_thw"][image : image + n]
            mrope, _ = model.model.get_rope_index(ids[:, a:b], vision["mm_token_type_ids"][:, a:b], grids)
            rows.append(torch.cat([text, mrope]))
        image += n
    return torch.cat(rows, dim=-1)


def per_document(vision, family, ids):
    """The vision inputs of each document of the packed batch, in document order."""
    out, image = [], 0
    for a, b in zip(DOCS[:-1], DOCS[1:]):
        n = int((ids[0, a:b] == IMAGE).sum()) // 4
        if family in PIXELS_4D:
            doc = {k: v[image : image + n] for k, v in vision.items()} if n else {}
        else:
            doc = {"pixel_values": vision["pixel_values"][16 * image : 16 * (image + n)],
                   "image_grid_thw": vision["image_grid_thw"][image : image + n],
                   "mm_token_type_ids": vision["mm_token_type_ids"][:, a:b]} if n else {}  # fmt: skip
        out.append(doc)
        image += n
    return out


def packed_reference(model, family, ids, labels, vision):
    """One process, each document on its own with its images: the mean loss over every
    document's targets, the gradients and the logits (joined)."""
    count = sum(int((labels[0, a + 1 : b] != -100).sum()) for a, b in zip(DOCS[:-1], DOCS[1:]))
    total, logits = 0.0, []
    for (a, b), doc in zip(zip(DOCS[:-1], DOCS[1:]), per_document(vision, family, ids)):
        out = model(input_ids=ids[:, a:b], **doc).logits
        loss = torch.nn.functional.cross_entropy(out[0, :-1], labels[0, a + 1 : b], ignore_index=-100, reduction="sum") / count
        loss.backward()
        total += loss.detach()
        logits.append(out.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return total, grads, torch.cat(logits, dim=1)


def check_packed(group):
    """Packed multimodal documents: documents from the text row of 4-row mRoPE positions (or
    Llava's restarting positions), and from ``cu_seqlens`` with the 3 mRoPE rows; loss, every
    gradient and the logits equal each document run on its own."""
    import torch.distributed as dist

    world = dist.get_world_size(group) if group is not None or dist.is_initialized() else 1
    for family in FAMILIES:
        ids, labels, vision = global_batch(family, PACKED_IMAGES, rows=1, seq=DOCS[-1])
        ref_loss, ref_grads, ref_logits = packed_reference(build(family), family, ids, labels, vision)
        model = hf.apply(build(family), group)
        positions = packed_positions(model, family, ids, vision)
        forms = [("positions", {})] + ([] if family in PIXELS_4D else [("cu_seqlens, 3 mRoPE rows", {"cu_seqlens": DOCS})])
        for by, extra in forms:
            what = f"packed {family}, world {world}, documents from {by}"
            mm = hf.multimodal_inputs(model, ids, position_ids=positions, **vision)
            if extra:
                mm["position_ids"] = mm["position_ids"][1:]
            batch = hf.shard_batch(ids, labels, group=group, **mm, **extra)
            assert list(batch.shard.documents.cu_seqlens) == DOCS, what
            out = model(**batch.model_inputs(loss=False))
            loss = batch.loss(out.logits)
            loss.backward()
            hf.sync_gradients(model, group)
            close(hf.reduce_loss(loss, group), ref_loss, 1e-12, f"{what}: loss")
            close(hf.gather_sequence(out.logits, batch.shard, group), ref_logits, 1e-12, f"{what}: logits")
            for name, p in model.named_parameters():
                if p.grad is not None:
                    close_grad(p.grad, ref_grads[name], grad_tolerance(family, name), f"{what}: grad of {name}")
            model.zero_grad(set_to_none=True)


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(hf.HFIntegrationError, match=match):
        fn(*args, **kwargs)


def build_gemma3():
    """Gemma 3 (SigLIP tower): its image tokens attend to each other both ways (``token_type_ids``)."""
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config={**TEXT, "query_pre_attn_scalar": 16, "sliding_window": 4},
        vision_config={"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 8,
                       "patch_size": 4},
        mm_tokens_per_image=4, image_token_id=IMAGE, boi_token_id=58, eoi_token_id=57, attn_implementation="sdpa",
    )).double()  # fmt: skip


def check_errors(rank, world):
    """Bad use raises the same clear error on every rank (each before any collective, or
    after the one batch check)."""
    ids, labels, vision = global_batch("qwen2_vl")
    model = hf.apply(build("qwen2_vl"))
    mm = hf.multimodal_inputs(model, ids, **vision)
    batch = hf.shard_batch(ids, labels, **mm)
    # Pixels with a sharded batch: the vision tower must run before sharding.
    _raises(r"\['pixel_values'\] given with a sharded batch; the vision tower runs before sharding", model, **batch.model_inputs(), **vision)
    if world > 1:
        # Sharded embeddings without the global positions: the text model would count from 0 on each rank.
        _raises("without position_ids", model, inputs_embeds=batch.inputs_embeds, ulysses_shard=batch.shard)
    # Qwen3-VL's deepstack inputs given to a model that takes none.
    ds = hf.multimodal_inputs(qwen3 := hf.apply(build("qwen3_vl")), ids, **vision)
    wrong = hf.shard_batch(ids, labels, **{**mm, "visual_pos_masks": ds["visual_pos_masks"], "deepstack_visual_embeds": ds["deepstack_visual_embeds"]})
    _raises("takes no 'visual_pos_masks'", model, **wrong.model_inputs())
    _raises("go together", hf.shard_batch, ids, labels, inputs_embeds=ds["inputs_embeds"], visual_pos_masks=ds["visual_pos_masks"])
    _raises(r"deepstack_visual_embeds\[0\] expected \[12 ", hf.shard_batch, ids, labels, inputs_embeds=ds["inputs_embeds"],
            visual_pos_masks=ds["visual_pos_masks"], deepstack_visual_embeds=[e[:-1] for e in ds["deepstack_visual_embeds"]])  # fmt: skip
    del qwen3
    # Shapes.
    pos = mm["position_ids"]
    _raises(r"mRoPE\) position_ids expected \[3 or 4, 2 or 1, 17\]", hf.shard_batch, ids, labels, position_ids=pos[:2])
    _raises(r"inputs_embeds expected \[2, 17, hidden\]", hf.shard_batch, ids, labels, inputs_embeds=mm["inputs_embeds"][:, :-1])
    _raises("may be None only with inputs_embeds and labels", hf.shard_batch, None, inputs_embeds=mm["inputs_embeds"])
    # (4-row positions whose text row restarts are packed documents per row at batch > 1 now, no longer
    # refused: tests/test_packed_batch.py and tests/test_hf_packed_batch.py.)
    # vision="split" needs a tower that takes image_grid_thw; an unknown mode is refused.
    llava_ids, _, llava_vision = global_batch("llava")
    _raises("is not a Qwen-VL model .* use vision='replicated'", hf.multimodal_inputs, hf.apply(build("llava")), llava_ids, vision="split", **llava_vision)
    _raises("vision expected 'replicated' or 'split', got 'halved'", hf.multimodal_inputs, model, ids, vision="halved", **vision)
    # A text-only model has no vision part to run.
    _raises("no separate text model", hf.multimodal_inputs, hf.apply(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEXT))), ids)
    # Gemma 3's image tokens attend both ways inside an image: a mask the sequence-parallel
    # attention cannot rebuild, refused when the batch is prepared.
    gemma = hf.apply(build_gemma3())
    pixels = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    _raises("cannot rebuild", hf.multimodal_inputs, gemma, ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long())
    if world > 1:
        # Ranks given other mRoPE positions for the same tokens: caught by the batch check.
        other = pos.clone()
        other[1:, :, 4] += rank
        _raises("different batches", hf.shard_batch, ids, labels, inputs_embeds=mm["inputs_embeds"], position_ids=other)


def check_video(group):
    """Qwen2-VL with an image and a video (2 temporal patches: 8 tokens, its t row counting
    0, 1 over frames) in one row, both across shard boundaries: loss, gradients and logits
    equal one process, the tower replicated."""
    import torch.distributed as dist

    world = dist.get_world_size(group) if group is not None or dist.is_initialized() else 1
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(3, 56, (1, 21), generator=g)
    ids[0, 3:7] = IMAGE
    ids[0, 9:17] = 59  # the video's 8 tokens
    labels = ids.masked_fill(ids >= 59, -100)
    vision = {
        "pixel_values": torch.randn(16, 24, generator=g, dtype=torch.float64), "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "pixel_values_videos": torch.randn(32, 24, generator=g, dtype=torch.float64), "video_grid_thw": torch.tensor([[2, 4, 4]]),
        "mm_token_type_ids": (ids == IMAGE).int() + 2 * (ids == 59).int(),
    }  # fmt: skip
    refs = reference(build("qwen2_vl"), ids, labels, vision)
    sharded_step(hf.apply(build("qwen2_vl"), group), "qwen2_vl", ids, labels, vision, group, f"qwen2_vl video, world {world}", refs)


def test_features_change_the_model():
    """What the path relies on matters far beyond the tolerances: the mRoPE positions (1-D
    positions instead) and Qwen3-VL's deepstack rows (left out)."""
    ids, labels, vision = global_batch("qwen3_vl")
    with torch.no_grad():
        ref = build("qwen3_vl")(input_ids=ids, **vision).logits
        model = hf.apply(build("qwen3_vl"))
        mm = hf.multimodal_inputs(model, ids, **vision)
        plain = hf.shard_batch(ids, labels, inputs_embeds=mm["inputs_embeds"], visual_pos_masks=mm["visual_pos_masks"],
                               deepstack_visual_embeds=mm["deepstack_visual_embeds"])  # fmt: skip
        no_deepstack = hf.shard_batch(ids, labels, inputs_embeds=mm["inputs_embeds"], position_ids=mm["position_ids"])
        full = hf.shard_batch(ids, labels, **mm)
        for batch, what in ((plain, "1-D positions"), (no_deepstack, "no deepstack")):
            err = ((model(**batch.model_inputs(loss=False)).logits - ref).abs().max() / ref.abs().max()).item()
            assert err > 1e-6, f"{what}: {err:.2e}"
        close(model(**full.model_inputs(loss=False)).logits, ref, 1e-12, "logits")


def test_errors_one_process():
    check_errors(0, 1)


def test_one_process_families():
    """Without torch.distributed (a group of one): the same path equals the model as built."""
    check_families(None)
    check_video(None)
    check_packed(None)


def check_sync_gradients(rank, world):
    """A parameter with a gradient on some ranks only (a rank that encoded no image under
    ``vision="split"``): the others take part with zeros, so the sum is right on every rank;
    one no rank reached keeps ``grad = None``. (Before, the ranks' flat buffers had other
    lengths: gloo's size mismatch.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)).double()
    x = torch.ones(1, 3, dtype=torch.float64) * (rank + 1)
    (model[0](x).sum() + (model[1](x).sum() if rank != 1 else 0)).backward()
    hf.sync_gradients(model)
    total = sum(r + 1 for r in range(world))
    assert torch.equal(model[0].weight.grad, torch.full((3, 3), float(total), dtype=torch.float64))
    assert torch.equal(model[1].weight.grad, torch.full((3, 3), float(total - 2), dtype=torch.float64))
    assert model[2].weight.grad is None and model[2].bias.grad is None


def job(rank, world):
    import torch.distributed as dist

    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    check_sync_gradients(rank, world)
    check_families(None)  # 4 ranks
    check_families(pairs[rank // 2])  # 2 ranks (two pairs at the same time)
    check_packed(None)
    check_packed(pairs[rank // 2])
    check_video(None)
    check_errors(rank, world)


def test_vlm_families_on_gloo():
    run_ranks(job, 4)
