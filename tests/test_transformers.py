"""Hugging Face transformers: attncc behind `attn_implementation=` gives the logits and
gradients of transformers' own implementations, on tiny randomly initialised models
built from configs (nothing downloaded), with padding, sliding windows, packed
sequences, a KV cache and softcapping; masks it does not read are refused.

transformers is the `hf` extra, which the `test` extra includes: these tests run in CI.
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # installed by the `test` extra

import attncc.integrations.transformers as hf  # noqa: E402
from attncc.errors import CallError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


@pytest.fixture(scope="module", autouse=True)
def registered():
    hf.register()  # "attncc"
    return "attncc"


def twins(model_class, config, reference="sdpa", implementation="attncc"):
    """The same randomly initialised weights under attncc and under `reference`."""
    torch.manual_seed(0)
    ref = model_class._from_config(copy.deepcopy(config), attn_implementation=reference)
    ours = model_class._from_config(copy.deepcopy(config), attn_implementation=implementation)
    ours.load_state_dict(ref.state_dict())
    return ours.to(DEVICE), ref.to(DEVICE)


def logits_and_grads(model, ids, attention_mask=None, **kwargs):
    """Logits at the real tokens, and the gradients of every weight for a loss on them."""
    model.zero_grad()
    logits = model(ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits
    real = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    logits = logits[real]
    torch.nn.functional.cross_entropy(logits, ids[real]).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_model(ours, ref, ids, attention_mask=None, **kwargs):
    logits, grads = logits_and_grads(ours, ids, attention_mask, **kwargs)
    ref_logits, ref_grads = logits_and_grads(ref, ids, attention_mask, **kwargs)
    assert torch.allclose(logits, ref_logits, rtol=1e-4, atol=1e-5), \
        (logits - ref_logits).abs().max()
    for name, g in grads.items():
        r = ref_grads[name]
        assert torch.allclose(g, r, rtol=1e-3, atol=1e-5 * max(1.0, r.abs().max().item())), \
            f"{name}: {(g - r).abs().max():.3g}"


def padded_batch(length=13):
    """Two rows of `length` tokens (one kernel tile under the interpreter), the first
    left-padded, the second right-padded."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, length), generator=gen).to(DEVICE)
    mask = torch.ones(2, length, dtype=torch.long, device=DEVICE)
    mask[0, :4] = 0
    mask[1, length - 5:] = 0
    return ids, mask


def test_llama_matches_sdpa_with_padding():
    ours, ref = twins(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL))
    assert_same_model(ours, ref, *padded_batch())


def test_sliding_window_layers_and_packed_sequences_match_sdpa():
    # Qwen2 with one sliding-window layer (window 4) and one full layer.
    config = transformers.Qwen2Config(**dict(SMALL, num_key_value_heads=2), use_sliding_window=True,
                                      sliding_window=4, max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    ours, ref = twins(transformers.Qwen2ForCausalLM, config)
    ids, _ = padded_batch(16)
    assert_same_model(ours, ref, ids)
    # Three sequences packed in one row, told apart by restarting position_ids.
    positions = torch.cat([torch.arange(6), torch.arange(1), torch.arange(9)]).view(1, 16)
    assert_same_model(ours, ref, ids[:1], position_ids=positions.to(DEVICE))
    kinds = {key[0] for key in hf._REGISTERED["attncc"].kernels}
    assert {(True, 4, False, False), (True, None, False, False), (True, 4, False, True),
            (True, None, False, True)} <= kinds  # (causal, window, padded, packed)


def test_softcap_and_query_scaling_match_eager():
    # Gemma 2: logit softcapping, a query scaling that is not 1/sqrt(head_dim), and
    # alternating sliding-window layers; SDPA refuses softcapping, so eager is the truth.
    config = transformers.Gemma2Config(**SMALL, head_dim=16, query_pre_attn_scalar=24,
                                       attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                       sliding_window=5)
    ours, ref = twins(transformers.Gemma2ForCausalLM, config, reference="eager")
    assert_same_model(ours, ref, *padded_batch())


def test_generation_with_a_kv_cache_matches_sdpa():
    config = transformers.MistralConfig(**SMALL, sliding_window=4)
    ours, ref = twins(transformers.MistralForCausalLM, config)
    ids, mask = padded_batch(6)
    mask[1] = 1
    # Decoding past the window: the cache's keys are offset from the queries.
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), ref.generate(ids, **kwargs))


# (The dynamic cache with a sliding window: test_generation_with_a_kv_cache_matches_sdpa.)
@pytest.mark.parametrize("model, cache", [("llama", "static"), ("gemma2_sliding_and_full", "static")])
def test_generation_with_each_cache_implementation_matches(model, cache):
    # A static cache makes generate build the mask before the forward and hand it back
    # to the model as attention_mask (a MaskInfo, not a tensor); Gemma 2 adds sliding
    # layers (a static sliding-window cache) and a dict of masks. Decoding runs past
    # the window, from a left-padded row.
    if model == "llama":
        config, cls, reference = transformers.LlamaConfig(**SMALL), transformers.LlamaForCausalLM, "sdpa"
    else:
        config = transformers.Gemma2Config(**SMALL, head_dim=16, query_pre_attn_scalar=24,
                                           attn_logit_softcapping=2.0,
                                           final_logit_softcapping=None, sliding_window=3)
        cls, reference = transformers.Gemma2ForCausalLM, "eager"
    ours, ref = twins(cls, config, reference=reference)
    ids, mask = padded_batch(7)
    mask[1] = 1
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                  cache_implementation=cache, output_logits=True, return_dict_in_generate=True)
    got, want = ours.generate(ids, **kwargs), ref.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step}: {m}")


def test_a_registered_variant_adds_its_mask_to_the_models():
    # Llama with a registered 4-key window equals Mistral's sliding window of 4 (the same
    # architecture and weights) under SDPA.
    name = hf.register("attncc_window4", variant="attention w4 { mask q - k < 4 }")
    config = transformers.LlamaConfig(**SMALL)
    torch.manual_seed(0)
    ref = transformers.MistralForCausalLM._from_config(
        transformers.MistralConfig(**SMALL, sliding_window=4), attn_implementation="sdpa")
    ours = transformers.LlamaForCausalLM._from_config(config, attn_implementation=name)
    ours.load_state_dict(ref.state_dict())
    assert_same_model(ours.to(DEVICE), ref.to(DEVICE), *padded_batch())


class _Layer(torch.nn.Module):
    is_causal = True


def test_masks_it_does_not_read_are_refused_naming_the_pair():
    # Chunked attention (Llama 4) is causal within chunks of 3: attncc's causal reading
    # would let query 3 see keys 0 to 2.
    from transformers.masking_utils import chunked_causal_mask_function
    chunked = chunked_causal_mask_function(3, torch.zeros(1, dtype=torch.long))
    info = hf.attncc_mask(batch_size=1, q_length=8, kv_length=8, mask_function=chunked)
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(CallError, match=r"transformers' mask for this layer forbids query 3 "
                                        r"to attend key 0 \(batch 0\), but attncc reads the "
                                        r"layer as `k <= q`"):
        hf._REGISTERED["attncc"](_Layer(), q, q, q, info)
    with pytest.raises(CallError, match=r"not as attncc's MaskInfo"):
        hf._REGISTERED["attncc"](_Layer(), q, q, q, torch.ones(1, 1, 8, 8, dtype=torch.bool))


def test_unknown_and_reserved_names_are_clear_errors():
    config = transformers.LlamaConfig(**SMALL)
    with pytest.raises(ValueError, match=r'attn_implementation="attncc_typo"` is not supported'):
        transformers.LlamaForCausalLM._from_config(config, attn_implementation="attncc_typo")
    with pytest.raises(CallError, match=r"contains 'sdpa', which transformers treats as its own"):
        hf.register("my_sdpa")
    with pytest.raises(CallError, match=r"no '/', ':' or '\|'"):
        hf.register("org/attncc")
    assert "attncc" in hf.registered()


def test_packed_sequence_ids_are_not_reused_for_a_new_tensor_with_a_freed_ones_id():
    """The ids found for one position_ids tensor are kept under (id, version). A new
    tensor can get a freed tensor's id (CPython reuses them): its packing must be read
    again. Here the kept entry is moved under the new tensor's key, the state an id
    reused after a free leaves behind."""
    # Causal, and no token of the second sequence sees the first (which starts at `first`).
    separate = lambda b, h, q, kv: kv <= q and not (q >= first and kv < first)  # noqa: E731
    first = 3
    info = hf.MaskInfo(1, 8, 8, 0, 0, None, separate, None, False)
    old = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])            # two sequences: 3 + 5 tokens
    old_ids = hf._packed_sequence_ids(info, old, 1, 8, 8)
    assert old_ids is not None and old_ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]
    new = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])            # 5 + 3 tokens
    info.sequence_ids[(id(new), new._version)] = info.sequence_ids.pop((id(old), old._version))
    first = 5
    new_ids = hf._packed_sequence_ids(info, new, 1, 8, 8)
    assert new_ids.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]]


def test_packed_sequence_ids_of_an_inference_tensor_are_read_each_call():
    """An inference tensor has no version counter (reading it crashed): its packing is
    not kept, so a write between calls is seen."""
    first = 3
    separate = lambda b, h, q, kv: kv <= q and not (q >= first and kv < first)  # noqa: E731
    info = hf.MaskInfo(1, 8, 8, 0, 0, None, separate, None, False)
    with torch.inference_mode():
        ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
        assert hf._packed_sequence_ids(info, ids, 1, 8, 8).tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]
        ids[0, 3:] = torch.tensor([3, 4, 0, 1, 2])
        first = 5
        assert hf._packed_sequence_ids(info, ids, 1, 8, 8).tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]]


def test_a_bidirectional_sliding_window_matches_eager():
    """A bidirectional layer's `sliding_window` W is exclusive, as a causal one's is
    (ModernBERT passes its mask's inclusive window + 1): read as abs(q - k) <= W, the
    window was one key too wide; check_masks refused it blaming the model, and with
    check_masks=False the logits were off by 1e-3."""
    config = transformers.ModernBertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, local_attention=4, global_attn_every_n_layers=2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    ours, ref = twins(transformers.ModernBertForMaskedLM, config, reference="eager")
    ids = torch.randint(3, 64, (2, 13), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    with torch.no_grad():
        got, want = (m.eval()(ids, attention_mask=mask).logits[mask.bool()] for m in (ours, ref))
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()


def _attend(name, info=None, **kwargs):
    """The attention function registered under `name`, called as a model's layer calls
    it: (batch 1, heads 2, 5 queries, head dim 16) against 5 keys."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=gen).to(DEVICE) for _ in range(3))
    return hf._REGISTERED[name](torch.nn.Module(), q, k, v, info, **kwargs)


def test_a_tensor_the_model_passes_and_attncc_does_not_read_is_refused(registered):
    """MiniMax-M3's sparse layers pass `block_indices=` (DeepSeek-V3.2 `indices=`), which
    transformers turns into a block mask only for eager and sdpa: attncc ran such layers
    densely, silently. Known tensors (position_ids, flash's cu_seq_lens) still pass."""
    with pytest.raises(CallError, match="passes `block_indices` to its attention"):
        _attend(registered, block_indices=torch.zeros(1, 2, 5, 1, dtype=torch.long))
    _attend(registered, position_ids=torch.arange(5)[None], output_hidden_states=True,
            cu_seq_lens_q=torch.tensor([0, 5], dtype=torch.int32))


def test_output_attentions_and_a_replaced_scale_warn():
    """output_attentions=True got None weights without a word (transformers' sdpa warns);
    a registered variant's `scale` replaced the model's scaling (Gemma2's
    query_pre_attn_scalar) silently."""
    name = hf.register("attncc_scaled", "attention scaled { scale 1.0 / sqrt(dim) }")
    with pytest.warns(UserWarning, match="output_attentions=True: attncc computes no attention"):
        out, weights = _attend(name, output_attentions=True)
    assert weights is None
    with pytest.warns(UserWarning, match=r"declares `scale`, which replaces the model's scaling "
                                         r"0.125 \(the variant's is 0.25 at head dim 16\)"):
        _attend(name, scaling=0.125)


def test_a_model_that_computes_with_its_mask_gets_a_clear_error():
    """Bloom, MPT, Gemma4 with shared KV layers and others index or add to the mask
    themselves: they crashed inside transformers on attncc's MaskInfo ('unsupported
    operand', 'not subscriptable')."""
    info = hf.attncc_mask(1, 5, 5)
    for use in (lambda: info[:, :, :3], lambda: info + 1.0, lambda: info.to(torch.float32),
                lambda: info.size(-1), lambda: ~info):
        with pytest.raises(CallError, match="computes with its attention mask itself"):
            use()
    assert info.shape == (1, 1, 5, 5) and info.ndim == 4


def test_a_layout_variant_at_a_caches_offset_is_named():
    """generate() decodes at the cache's offset, which a layout's tiles cannot start at:
    the message named a q_offset the user never passed."""
    name = hf.register("attncc_blocks", "attention blocks { layout kb <= qb\n block 16 }")
    with pytest.raises(CallError, match=r"'blocks' has a layout \(block 16\).*queries start at "
                                        r"position 12.*register a variant without a layout"):
        gen = torch.Generator().manual_seed(5)
        q = torch.randn(1, 2, 1, 16, generator=gen).to(DEVICE)
        kv = torch.randn(1, 2, 13, 16, generator=gen).to(DEVICE)
        hf._REGISTERED[name](torch.nn.Module(), q, kv, kv, hf.attncc_mask(1, 1, 13, q_offset=12))
