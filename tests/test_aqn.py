"""AQN: the sigma schedule at stage boundaries, decay shapes, and redrawn (never accumulated) noise."""

import math
from itertools import pairwise

import pytest
import torch

from qerl_pipeline.config import AQNConfig
from qerl_pipeline.quantization import aqn


def test_stages_split_total_steps():
    # 20 steps, 5 stages: 4 steps each
    stages = [aqn.stage_of(s, 20, 5) for s in range(20)]
    assert stages == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    # uneven: 7 steps, 3 stages -> floor(s*3/7)
    assert [aqn.stage_of(s, 7, 3) for s in range(7)] == [0, 0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError):
        aqn.stage_of(7, 7, 3)


def test_exponential_schedule_matches_paper_formula():
    cfg = AQNConfig(sigma_start=1e-2, sigma_end=5e-4, num_stages=10)
    sig = [aqn.sigma_at(s, 100, cfg) for s in range(100)]
    assert sig[0] == (0, 0.0) and sig[9] == (0, 0.0)
    assert sig[10] == (1, pytest.approx(1e-2))  # first noisy stage = sigma_start
    assert sig[99] == (9, pytest.approx(5e-4))  # last stage = sigma_end
    for k in range(1, 10):
        want = 1e-2 * (5e-4 / 1e-2) ** ((k - 1) / 8)
        assert aqn.stage_sigma(k, cfg) == pytest.approx(want, rel=1e-12)
    # geometric: constant ratio between stages
    ratios = [aqn.stage_sigma(k + 1, cfg) / aqn.stage_sigma(k, cfg) for k in range(1, 9)]
    assert max(ratios) == pytest.approx(min(ratios))


def test_two_stages():
    cfg = AQNConfig(sigma_start=1e-2, sigma_end=5e-4, num_stages=2)
    assert [aqn.sigma_at(s, 4, cfg) for s in range(4)] == [(0, 0.0), (0, 0.0), (1, 1e-2), (1, 1e-2)]


@pytest.mark.parametrize("decay", ["exponential", "linear", "cosine", "logarithmic"])
def test_decay_shapes_endpoints_and_monotone(decay):
    cfg = AQNConfig(sigma_start=1e-2, sigma_end=5e-4, num_stages=6, decay=decay)
    vals = [aqn.stage_sigma(k, cfg) for k in range(6)]
    assert vals[0] == 0.0
    assert vals[1] == pytest.approx(1e-2) and vals[5] == pytest.approx(5e-4)
    assert all(a >= b for a, b in pairwise(vals[1:]))


def test_decay_shapes_midpoints():
    mid = {}
    for decay in ("exponential", "linear", "cosine", "logarithmic"):
        cfg = AQNConfig(sigma_start=1.0, sigma_end=0.01, num_stages=4, decay=decay)
        mid[decay] = aqn.stage_sigma(2, cfg)  # t = 1/2
    assert mid["exponential"] == pytest.approx(0.1)
    assert mid["linear"] == pytest.approx(0.505)
    assert mid["cosine"] == pytest.approx(0.505)  # cos(pi/2) = 0: the midpoint of start and end
    assert mid["logarithmic"] == pytest.approx(1 - 0.99 * math.log(5.5) / math.log(10))
    cfg = AQNConfig(sigma_start=1.0, sigma_end=0.01, num_stages=6, decay="cosine")
    # t = 1/4: cosine stays closer to start than linear
    assert aqn.stage_sigma(2, cfg) > 1 - 0.99 / 4


def _clean():
    return {
        "model.layers.1.input_layernorm.weight": torch.ones(8),
        "model.layers.0.post_attention_layernorm.weight": torch.full((8,), 0.5),
    }


def test_noise_is_redrawn_from_clean_not_accumulated():
    clean = _clean()
    z1 = aqn.draw_noise(clean, 0.1, seed=3, step=1)
    z1b = aqn.draw_noise(clean, 0.1, seed=3, step=1)
    z2 = aqn.draw_noise(clean, 0.1, seed=3, step=2)
    for n in clean:
        assert torch.equal(z1[n], z1b[n])  # same (seed, step): same noise (resume contract)
        assert not torch.equal(z1[n], z2[n])
        assert 0.02 < float(z1[n].std()) < 0.3
    noisy1 = aqn.apply_noise(clean, z1)
    noisy2 = aqn.apply_noise(clean, z2)
    for n in clean:
        assert torch.equal(noisy2[n], clean[n] + z2[n])  # from clean, not from noisy1
        assert not torch.equal(noisy2[n], noisy1[n] + z2[n])
        assert torch.equal(clean[n], _clean()[n])  # inputs untouched


def test_sigma_zero_is_exact():
    clean = {"a.input_layernorm.weight": torch.randn(16)}
    z = aqn.draw_noise(clean, 0.0, seed=0, step=5)
    noisy = aqn.apply_noise(clean, z)
    assert torch.equal(noisy["a.input_layernorm.weight"], clean["a.input_layernorm.weight"])


def test_noisy_target_names():
    names = [
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
    ]
    assert aqn.noisy_target_names(names) == names[1:3]


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = torch.nn.Module()
        self.input_layernorm.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return (x * self.input_layernorm.weight).sum()


def test_noisy_norms_context_gradient_to_clean_and_exact_restore():
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([_Block()])
    params = aqn.norm_parameters(m, ["layers.0.input_layernorm.weight"])
    clean = {k: p.detach().clone() for k, p in params.items()}
    z = aqn.draw_noise(clean, 0.5, seed=1, step=0)
    noisy = aqn.apply_noise(clean, z)
    x = torch.arange(4.0)
    with aqn.noisy_norms(params, noisy):
        y = m.layers[0](x)
        (y**2).backward()
        assert torch.equal(
            params["layers.0.input_layernorm.weight"].detach(), noisy["layers.0.input_layernorm.weight"]
        )
    w = params["layers.0.input_layernorm.weight"]
    assert torch.equal(w.detach(), clean["layers.0.input_layernorm.weight"])  # bit-exact restore
    # d/dw (sum x*(w+z))^2 = 2 * y_noisy * x: evaluated at the noisy point
    y_noisy = float((x * noisy["layers.0.input_layernorm.weight"]).sum())
    assert torch.allclose(w.grad, 2 * y_noisy * x)
    with pytest.raises(KeyError):
        aqn.norm_parameters(m, ["layers.1.input_layernorm.weight"])
