"""MXFP4 expert weights of gpt-oss checkpoints (engine/models/mxfp4.py).

Dequantizing equals transformers' own conversion bit for bit (float32 and bf16), every nibble code and
scale means what the format says, a checkpoint's packed pairs become exactly the GptOssExperts
parameters (so a bf16 loader sees what a bf16 gpt-oss checkpoint holds), mistakes are clear
ValueErrors, and quantize_mxfp4 inverts dequantizing: exactly on representable values, to the nearest
grid point otherwise."""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine.models.mxfp4 import (
    FP4_E2M1_VALUES,
    dequantize_checkpoint,
    dequantize_mxfp4,
    is_mxfp4,
    quantize_mxfp4,
)

EXPERTS, ROWS, GROUPS = 3, 64, 4


def _random_packed(seed: int, shape=(EXPERTS, ROWS, GROUPS)) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 141, shape, dtype=torch.uint8, generator=generator)
    return blocks, scales


def _transformers_convert():
    return pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_transformers(dtype):
    convert = _transformers_convert()
    blocks, scales = _random_packed(0)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    assert ours.shape == (EXPERTS, ROWS, GROUPS * 32) and ours.dtype == dtype
    # transformers transposes dims 1 and 2 after dequantizing; dequantize_mxfp4 keeps the stored layout.
    theirs = convert(blocks.clone(), scales.clone(), dtype=dtype)
    assert theirs.shape == (EXPERTS, GROUPS * 32, ROWS)
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_every_code_in_both_nibbles_and_scales():
    codes = torch.arange(16, dtype=torch.uint8)
    # Byte j of a group = value 2j (low nibble) and 2j+1 (high nibble). Row 0 puts code j in the low
    # nibble of byte j (high nibble 0 -> +0.0); row 1 puts it in the high nibble (low nibble 0).
    blocks = torch.stack((codes, codes << 4)).reshape(2, 1, 16)
    expected = torch.tensor(FP4_E2M1_VALUES)
    assert expected.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    for scale, factor in ((127, 1.0), (128, 2.0), (126, 0.5), (120, 2.0**-7)):
        values = dequantize_mxfp4(blocks, torch.full((2, 1), scale, dtype=torch.uint8), torch.float32)
        low, high = values[0], values[1]
        assert torch.equal(low[0::2], expected * factor)
        assert torch.equal(high[1::2], expected * factor)
        assert torch.equal(low[1::2], torch.zeros(16)) and torch.equal(high[0::2], torch.zeros(16))
        # Negative codes really are negative zero / negative, not just equal under ==.
        assert torch.equal(torch.signbit(low[0::2]), torch.arange(16) >= 8)
    # e8m0's 255 is NaN in the OCP MX spec; a corrupt scale must not pass as a number.
    nan_scale = dequantize_mxfp4(blocks, torch.full((2, 1), 255, dtype=torch.uint8), torch.float32)
    assert torch.isnan(nan_scale).all()


def test_dequantize_rejects_bad_inputs():
    blocks, scales = _random_packed(1)
    with pytest.raises(ValueError, match=r"\(3, 64, 4, 16\).*\(3, 64, 5\)"):
        dequantize_mxfp4(blocks, torch.zeros(3, 64, 5, dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks, scales.to(torch.int32), torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.to(torch.int16), scales, torch.float32)


def test_dequantize_checkpoint_gives_gpt_oss_expert_parameters():
    convert = _transformers_convert()
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    hidden, intermediate = 64, 96  # H/32 = 2 groups, I/32 = 3 groups
    gate_up_blocks, gate_up_scales = _random_packed(2, (EXPERTS, 2 * intermediate, hidden // 32))
    down_blocks, down_scales = _random_packed(3, (EXPERTS, hidden, intermediate // 32))
    prefix = "model.layers.0.mlp.experts."
    gate_up_bias = torch.randn(EXPERTS, 2 * intermediate).to(torch.bfloat16)
    down_bias = torch.randn(EXPERTS, hidden).to(torch.bfloat16)
    router_weight = torch.randn(EXPERTS, hidden).to(torch.bfloat16)
    checkpoint = {
        prefix + "gate_up_proj_blocks": gate_up_blocks,
        prefix + "gate_up_proj_scales": gate_up_scales,
        prefix + "gate_up_proj_bias": gate_up_bias,
        prefix + "down_proj_scales": down_scales,  # scales before blocks: order must not matter
        prefix + "down_proj_blocks": down_blocks,
        prefix + "down_proj_bias": down_bias,
        "model.layers.0.mlp.router.weight": router_weight,
    }
    converted = dequantize_checkpoint(dict(checkpoint), torch.bfloat16)

    assert not any(name.endswith(("_blocks", "_scales")) for name in converted)
    assert set(converted) == {
        prefix + "gate_up_proj",
        prefix + "gate_up_proj_bias",
        prefix + "down_proj",
        prefix + "down_proj_bias",
        "model.layers.0.mlp.router.weight",
    }
    assert converted[prefix + "gate_up_proj_bias"] is gate_up_bias
    assert converted[prefix + "down_proj_bias"] is down_bias
    assert converted["model.layers.0.mlp.router.weight"] is router_weight

    gate_up, down = converted[prefix + "gate_up_proj"], converted[prefix + "down_proj"]
    assert gate_up.shape == (EXPERTS, hidden, 2 * intermediate) and gate_up.dtype == torch.bfloat16
    assert down.shape == (EXPERTS, intermediate, hidden) and down.dtype == torch.bfloat16
    assert gate_up.is_contiguous() and down.is_contiguous()
    assert torch.equal(gate_up, convert(gate_up_blocks, gate_up_scales, dtype=torch.bfloat16))
    assert torch.equal(down, convert(down_blocks, down_scales, dtype=torch.bfloat16))

    # The result loads straight into transformers' GptOssExperts (shapes checked strictly).
    config = GptOssConfig(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=EXPERTS)
    experts = modeling.GptOssExperts(config).to(torch.bfloat16)
    experts.load_state_dict({name.removeprefix(prefix): t for name, t in converted.items() if name.startswith(prefix)})
    assert torch.equal(experts.gate_up_proj.data, gate_up) and torch.equal(experts.down_proj.data, down)


def test_dequantize_checkpoint_rejects_unpaired_and_mismatched():
    blocks, scales = _random_packed(4)
    name = "model.layers.7.mlp.experts.gate_up_proj"
    with pytest.raises(ValueError, match=r"model\.layers\.7\.mlp\.experts\.gate_up_proj_blocks"):
        dequantize_checkpoint({name + "_blocks": blocks}, torch.bfloat16)
    with pytest.raises(ValueError, match=r"model\.layers\.7\.mlp\.experts\.gate_up_proj_scales"):
        dequantize_checkpoint({name + "_scales": scales, "other.weight": torch.zeros(2)}, torch.bfloat16)
    with pytest.raises(ValueError, match=r"\(3, 64, 4, 16\).*\(3, 32, 4\)"):
        dequantize_checkpoint({name + "_blocks": blocks, name + "_scales": scales[:, :32]}, torch.bfloat16)


def _fp4_times_powers_of_two(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Random FP4 values, each group of 32 times its own power of two, each group's amax random."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (*shape, 32), generator=generator)
    values = torch.tensor(FP4_E2M1_VALUES)[codes]
    # Cap each group at a random code so groups whose largest magnitude is 0.5, 1, 1.5, ... all occur.
    cap = torch.tensor(FP4_E2M1_VALUES[:8])[torch.randint(1, 8, (*shape, 1), generator=generator)]
    values = values.clamp(-cap, cap)
    exponents = torch.randint(-20, 21, (*shape, 1), generator=generator)
    return (values * torch.pow(2.0, exponents.double())).float().reshape(*shape[:-1], shape[-1] * 32)


def test_quantize_round_trip_exact_on_representable_values():
    weight = _fp4_times_powers_of_two(5, (4, 16, 6))
    weight[0, :, :32] = 0.0  # an all-zero group
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (4, 16, 6, 16) and blocks.dtype == torch.uint8
    assert scales.shape == (4, 16, 6) and scales.dtype == torch.uint8
    assert torch.equal(scales[0, :, 0], torch.full((16,), 127, dtype=torch.uint8))
    assert ((weight == 0) & torch.signbit(weight)).any()  # negative zeros are in the test data
    for dtype in (torch.float32, torch.bfloat16):
        restored = dequantize_mxfp4(blocks, scales, dtype)
        assert torch.equal(restored, weight.to(dtype))
        assert torch.equal(torch.signbit(restored), torch.signbit(weight))  # -0.0 stays -0.0
    # And the packed form is transformers': its conversion gives back the weight too.
    convert = _transformers_convert()
    assert torch.equal(convert(blocks, scales, dtype=torch.float32).transpose(1, 2), weight)


def test_quantize_rounds_to_nearest_grid_point():
    weight = torch.randn(8, 4, 256, generator=torch.Generator().manual_seed(6))
    weight[1, 2, 64:96] = 0.0
    blocks, scales = quantize_mxfp4(weight.to(torch.bfloat16))
    restored = dequantize_mxfp4(blocks, scales, torch.float32)
    weight = weight.to(torch.bfloat16).float()

    groups = weight.reshape(8, 4, 8, 32)
    errors = (restored.reshape(8, 4, 8, 32) - groups).abs()
    amax = groups.abs().amax(dim=-1, keepdim=True)
    assert (errors <= 0.25 * amax).all()
    assert torch.equal(restored[1, 2, 64:96], torch.zeros(32))
    assert (scales[1, 2, 2] == 127).item()
    # The scale is the smallest power of two that fits the group's amax into +-6.
    scale_factor = torch.pow(2.0, scales.double() - 127).float().unsqueeze(-1)
    assert (amax <= 6 * scale_factor).all()
    nonzero = amax > 0
    assert (amax > 3 * scale_factor)[nonzero].all()
    # Each value is the nearest of its group's 16 grid values.
    grid = torch.tensor(FP4_E2M1_VALUES) * scale_factor  # [8, 4, 8, 16]
    nearest = (groups.unsqueeze(-1) - grid.unsqueeze(-2)).abs().amin(dim=-1)
    assert torch.equal(errors, nearest)


def test_quantize_ties_go_to_even_code():
    # One group with amax 6 (scale 127): midpoints 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    # 2.5 -> 2, 3.5 -> 4, 5 -> 4, and the same negated.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    weight = torch.zeros(32)
    weight[0] = 6.0
    weight[1:8] = torch.tensor(ties)
    weight[8:15] = -torch.tensor(ties)
    blocks, scales = quantize_mxfp4(weight)
    assert scales.tolist() == [127]
    restored = dequantize_mxfp4(blocks, scales, torch.float32)
    assert restored[1:8].tolist() == expected
    assert restored[8:15].tolist() == [-v for v in expected]


def test_quantize_rejects_bad_shapes_and_values():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_mxfp4(torch.tensor([float("inf")] + [0.0] * 31))


def test_is_mxfp4():
    assert is_mxfp4({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []}})
    assert not is_mxfp4({"quantization_config": {"quant_method": "fp8"}})
    assert not is_mxfp4({"model_type": "gpt_oss"})
    assert not is_mxfp4({"quantization_config": None})
