"""Update rules of the parameter-server shard (servers/rules.py): plain objects, no processes.

The reference is torch.optim on one flat parameter fed the same gradients.
"""

import io
import warnings

import pytest
import torch

from asyncsgd.servers.rules import (RULES, SGD, Adagrad, Adam, DelayedNesterov, Momentum,
                                    Nesterov, UpdateRule, dc_asgd, make_rule, staleness_scale)

SIZE = 50
STEPS = 10


class DelayedNesterovReference(torch.optim.Optimizer):
    """Liu et al. 2024's delayed Nesterov (c = 0) as a torch optimizer, written from the
    paper: the gradient term at every step, the momentum every ``period`` steps from the
    mean of the period's gradients."""

    def __init__(self, params, lr, momentum, period, foreach=False):
        super().__init__(params, {"lr": lr})
        self.momentum, self.period, self.t = momentum, period, 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["m"], state["delta"] = torch.zeros_like(p), torch.zeros_like(p)
                state["delta"].add_(p.grad)
                if self.t % self.period == 0:
                    state["m"].mul_(self.momentum).add_(state["delta"], alpha=1.0 / self.period)
                    p.add_(state["m"], alpha=-group["lr"] * self.momentum)
                    state["delta"].zero_()
                p.add_(p.grad, alpha=-group["lr"] / self.period)


# (rule name, rule hyperparameters, torch.optim class, its keyword arguments)
CASES = {
    "sgd": ("sgd", {}, "SGD", {}),
    "sgd_wd": ("sgd", {"weight_decay": 0.01}, "SGD", {"weight_decay": 0.01}),
    "momentum": ("momentum", {}, "SGD", {"momentum": 0.9}),
    "momentum_wd_nesterov": ("momentum", {"momentum": 0.8, "weight_decay": 0.01, "nesterov": True},
                             "SGD", {"momentum": 0.8, "weight_decay": 0.01, "nesterov": True}),
    "adagrad": ("adagrad", {}, "Adagrad", {}),
    "adagrad_wd": ("adagrad", {"weight_decay": 0.01}, "Adagrad", {"weight_decay": 0.01}),
    "adam": ("adam", {}, "Adam", {}),
    "adam_custom": ("adam", {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.01},
                    "Adam", {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.01}),
    "nesterov": ("nesterov", {}, "SGD", {"momentum": 0.9, "nesterov": True}),
    "delayed-nesterov": ("delayed-nesterov", {"period": 3}, DelayedNesterovReference,
                         {"momentum": 0.9, "period": 3}),
    "delayed-nesterov_every_push": ("delayed-nesterov", {"period": 1, "momentum": 0.5},
                                    DelayedNesterovReference, {"momentum": 0.5, "period": 1}),
}
# bit for bit: the outer optimizers of --local-steps (the issue asks for it; the others'
# tests allow 1e-6, their arithmetic being the same op for op as well)
EXACT = ("nesterov", "delayed-nesterov", "delayed-nesterov_every_push", "momentum_wd_nesterov")
LR = {"sgd": 0.1, "momentum": 0.05, "adagrad": 0.1, "adam": 0.01, "nesterov": 0.7,
      "delayed-nesterov": 0.05}



def grads(n=STEPS, size=SIZE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=gen) for _ in range(n)]


def init_params(size=SIZE, seed=1):
    return torch.randn(size, generator=torch.Generator().manual_seed(seed))


def split3(g):
    """Three disjoint segments covering g, pushed out of order."""
    a, b = len(g) // 3, 2 * len(g) // 3
    return [(b, g[b:]), (0, g[:a]), (a, g[a:b])]


def readonly(t):
    """A read-only tensor like the server's view of a received buffer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The given buffer is not writable"
        return torch.frombuffer(t.numpy().tobytes(), dtype=torch.float32)


def torch_reference(opt_name, opt_kw, lr, gs, p0):
    p = torch.nn.Parameter(p0.clone())
    cls = getattr(torch.optim, opt_name) if isinstance(opt_name, str) else opt_name
    opt = cls([p], lr=lr, foreach=False, **opt_kw)
    for g in gs:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("split", [False, True], ids=["whole", "3segments"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_optim(case, split):
    name, hyper, opt_name, opt_kw = CASES[case]
    lr, gs, p0 = LR[name], grads(), init_params()
    expected = torch_reference(opt_name, opt_kw, lr, gs, p0)

    rule = make_rule(name, SIZE, lr, **hyper)
    params = p0.clone()
    for g in gs:
        g_ro = readonly(g)
        rule.step(params, split3(g_ro) if split else [(0, g_ro)])
        assert torch.equal(g_ro, g)  # the received gradient is never written
    assert rule.steps == STEPS  # one step per push, however many segments
    torch.testing.assert_close(params, expected, rtol=0, atol=1e-6)
    if case in EXACT:
        assert torch.equal(params, expected)


@pytest.mark.parametrize("split", [False, True], ids=["whole", "3segments"])
def test_sgd_lr_scale_matches_torch(split):
    lr, scale, gs, p0 = 0.1, 0.25, grads(), init_params()
    expected = torch_reference("SGD", {"weight_decay": 0.01}, lr * scale, gs, p0)
    rule = SGD(SIZE, lr, weight_decay=0.01)
    params = p0.clone()
    for g in gs:
        rule.step(params, split3(g) if split else [(0, g)], lr_scale=scale)
    torch.testing.assert_close(params, expected, rtol=0, atol=1e-6)


def test_lr_scale_with_staleness_matches_torch_per_step():
    """A different lr_scale each push equals torch SGD with lr changed before each step."""
    lr, gs, p0 = 0.1, grads(), init_params()
    stale = [0, 1, 2, 5, 3, 1, 7, 0, 4, 2]
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.SGD([p], lr=lr, momentum=0.9, foreach=False)
    rule = Momentum(SIZE, lr)
    params = p0.clone()
    for g, s in zip(gs, stale):
        opt.param_groups[0]["lr"] = lr * staleness_scale(s)
        p.grad = g.clone()
        opt.step()
        rule.step(params, split3(g), lr_scale=staleness_scale(s))
    torch.testing.assert_close(params, p.detach(), rtol=0, atol=1e-6)


def test_sgd_exact_integer_oracle():
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randint(-1000, 1000, (SIZE,), generator=gen).float()
    gs = [torch.randint(-50, 50, (SIZE,), generator=gen).float() for _ in range(20)]
    params = p0.clone()
    rule = make_rule("sgd", SIZE, 1.0)
    for i, g in enumerate(gs):
        rule.step(params, split3(g) if i % 2 else [(0, g)])
    assert torch.equal(params, p0 - torch.stack(gs).sum(0))


@pytest.mark.parametrize("name", RULES)
def test_partial_push_changes_only_its_range(name):
    lr, gs, p0 = LR[name], grads(3), init_params()
    rule = make_rule(name, SIZE, lr)
    params = p0.clone()
    rule.step(params, [(0, gs[0])])  # full push: state is non-zero everywhere
    before_p, before_s = params.clone(), rule.state_dict()["state"]
    lo, hi = 10, 23
    g = gs[1][lo:hi].clone()
    rule.step(params, [(lo, g)])
    inside = torch.zeros(SIZE, dtype=torch.bool)
    inside[lo:hi] = True
    assert torch.equal(params[~inside], before_p[~inside])
    assert not torch.equal(params[inside], before_p[inside])
    after_s = rule.state_dict()["state"]
    for key in rule.STATE:
        assert torch.equal(after_s[key][~inside], before_s[key][~inside]), key
        assert not torch.equal(after_s[key][inside], before_s[key][inside]), key
    assert rule.steps == 2


@pytest.mark.parametrize("name", RULES)
def test_partial_push_first_step_matches_torch_on_its_range(name):
    """On a fresh rule a partial push is torch's first step restricted to that range."""
    _, hyper, opt_name, opt_kw = CASES[name]
    lr, g, p0 = LR[name], grads(1)[0], init_params()
    expected = torch_reference(opt_name, opt_kw, lr, [g], p0)
    rule = make_rule(name, SIZE, lr, **hyper)
    params = p0.clone()
    rule.step(params, [(5, g[5:17]), (30, g[30:31])])
    for lo, hi in ((5, 17), (30, 31)):
        torch.testing.assert_close(params[lo:hi], expected[lo:hi], rtol=0, atol=1e-6)
    assert torch.equal(params[:5], p0[:5]) and torch.equal(params[17:30], p0[17:30])
    assert torch.equal(params[31:], p0[31:])


def _bad_pushes():
    g = torch.ones(SIZE)
    return {
        "negative_offset": [(-1, g[:5])],
        "offset_at_size": [(SIZE, g[:1])],
        "past_end": [(SIZE - 3, g[:5])],
        "too_long": [(0, torch.ones(SIZE + 1))],
        "empty": [(0, g[:0])],
        "float64": [(0, torch.ones(SIZE, dtype=torch.float64))],
        "int": [(0, torch.ones(SIZE, dtype=torch.int32))],
        "2d": [(0, torch.ones(1, SIZE))],
        "0d": [(0, torch.tensor(1.0))],
        "not_tensor": [(0, [1.0] * SIZE)],
        "float_offset": [(1.5, g[:5])],
        "bool_offset": [(True, g[:5])],
        "not_pair": [(0, g, 1)],
        "overlap": [(0, g[:10]), (5, g[:10])],
        # valid segments first: nothing may be applied before the bad one is found
        "good_then_bad": [(0, g[:10]), (10, g[:10]), (45, g[:10])],
    }


@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("bad", sorted(_bad_pushes()))
def test_invalid_push_raises_and_changes_nothing(name, bad):
    rule = make_rule(name, SIZE, LR[name])
    params = init_params()
    rule.step(params, [(0, grads(1)[0])])
    before_p, before = params.clone(), rule.state_dict()
    with pytest.raises(ValueError):
        rule.step(params, _bad_pushes()[bad])
    assert torch.equal(params, before_p)
    after = rule.state_dict()
    assert after["steps"] == before["steps"]
    for key in rule.STATE:
        assert torch.equal(after["state"][key], before["state"][key])


@pytest.mark.parametrize("params", [torch.zeros(SIZE + 1), torch.zeros(SIZE, dtype=torch.float64),
                                    torch.zeros(2, SIZE // 2)], ids=["size", "dtype", "2d"])
def test_wrong_params_raise(params):
    with pytest.raises(ValueError):
        SGD(SIZE, 0.1).step(params, [(0, torch.ones(SIZE))])


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_lr_scale_raises(scale):
    params = init_params()
    with pytest.raises(ValueError):
        SGD(SIZE, 0.1).step(params, [(0, torch.ones(SIZE))], lr_scale=scale)
    assert torch.equal(params, init_params())


@pytest.mark.parametrize("name", RULES)
def test_state_dict_round_trip(name, tmp_path):
    _, hyper, _, _ = CASES[name]
    lr, gs, p0 = LR[name], grads(), init_params()
    whole = make_rule(name, SIZE, lr, **hyper)
    p_whole = p0.clone()
    for g in gs:
        whole.step(p_whole, split3(g))

    first = make_rule(name, SIZE, lr, **hyper)
    p = p0.clone()
    for g in gs[:4]:
        first.step(p, split3(g))
    path = tmp_path / "rule.pt"
    torch.save({"params": p, "rule": first.state_dict()}, path)
    first.step(p, [(0, gs[4])])  # the snapshot must not see later steps

    saved = torch.load(path, weights_only=True)
    second = make_rule(name, SIZE, lr, **hyper)
    ptrs = {k: t.data_ptr() for k, t in second.state.items()}
    second.load_state_dict(saved["rule"])
    assert {k: t.data_ptr() for k, t in second.state.items()} == ptrs  # loaded in place
    assert second.steps == 4
    p = saved["params"]
    for g in gs[4:]:
        second.step(p, split3(g))
    assert torch.equal(p, p_whole)
    for key in whole.STATE:
        assert torch.equal(second.state[key], whole.state[key])


@pytest.mark.parametrize("name", RULES)
def test_load_state_dict_mismatches_raise(name):
    rule = make_rule(name, SIZE, LR[name])
    rule.step(init_params(), [(0, grads(1)[0])])
    state = rule.state_dict()
    with pytest.raises(ValueError, match="size"):
        make_rule(name, SIZE + 1, LR[name]).load_state_dict(state)
    other = next(n for n in RULES if n != name)
    with pytest.raises(ValueError, match="rule"):
        make_rule(other, SIZE, LR[other]).load_state_dict(state)
    with pytest.raises(ValueError):
        make_rule(name, SIZE, LR[name]).load_state_dict({"name": name})
    if rule.STATE:
        bad = dict(state, state={k: t[:-1].clone() for k, t in state["state"].items()})
        fresh = make_rule(name, SIZE, LR[name])
        with pytest.raises(ValueError):
            fresh.load_state_dict(bad)
        assert fresh.steps == 0  # nothing loaded on failure


def test_state_dict_holds_only_plain_types():
    def check(obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                assert isinstance(k, str)
                check(v)
        else:
            assert type(obj) in (torch.Tensor, int, float, str), type(obj)

    for name in RULES:
        state = make_rule(name, SIZE, LR[name], **CASES[name][1]).state_dict()
        check(state)
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)


def test_state_allocated_once():
    rule = Adam(SIZE, 0.01)
    ptrs = {k: t.data_ptr() for k, t in rule.state.items()}
    params = init_params()
    for g in grads(3):
        rule.step(params, split3(g))
    assert {k: t.data_ptr() for k, t in rule.state.items()} == ptrs


def test_make_rule():
    assert RULES == ("sgd", "momentum", "adagrad", "adam", "nesterov", "delayed-nesterov")
    for name, cls in zip(RULES, (SGD, Momentum, Adagrad, Adam, Nesterov, DelayedNesterov)):
        rule = make_rule(name, 7, 0.1)
        assert type(rule) is cls and isinstance(rule, UpdateRule) and rule.name == name
        assert rule.size == 7 and rule.lr == 0.1
    with pytest.raises(ValueError) as err:
        make_rule("rmsprop", 7, 0.1)
    for name in RULES:
        assert name in str(err.value)


@pytest.mark.parametrize("args,hyper", [
    ((7.5, 0.1), {}), ((-3, 0.1), {}), ((7, 0.0), {}), ((7, -0.1), {}), ((7, float("nan")), {}),
    ((7, 0.1), {"momentum": 0.9}),  # not an SGD hyperparameter
    ((7, 0.1), {"weight_decay": -1.0}),
])
def test_bad_construction_raises(args, hyper):
    with pytest.raises(ValueError):
        make_rule("sgd", *args, **hyper)


def test_bad_hyperparameters_raise():
    with pytest.raises(ValueError):
        Momentum(7, 0.1, momentum=1.0)
    with pytest.raises(ValueError):
        Momentum(7, 0.1, momentum=0.0, nesterov=True)
    with pytest.raises(ValueError):
        Adam(7, 0.1, betas=(0.9,))
    with pytest.raises(ValueError):
        Adam(7, 0.1, betas=(0.9, 1.0))
    with pytest.raises(ValueError):
        Adagrad(7, 0.1, eps=-1.0)


def test_staleness_scale():
    assert staleness_scale(0) == 1.0
    assert staleness_scale(1) == 1.0
    assert staleness_scale(2) == 0.5
    assert staleness_scale(4) == 0.25
    assert staleness_scale(10) == pytest.approx(0.1)
    assert isinstance(staleness_scale(3), float)
    with pytest.raises(ValueError):
        staleness_scale(-1)
    with pytest.raises(ValueError):
        staleness_scale(1.5)


def test_dc_asgd_formula_and_inputs_untouched():
    g = torch.tensor([1.0, -2.0, 0.5, 3.0])
    params = torch.tensor([1.0, 2.0, 3.0, -1.0])
    backup = torch.tensor([0.0, 2.5, 3.0, 1.0])
    copies = [t.clone() for t in (g, params, backup)]
    out = dc_asgd(g, params, backup, 0.5)
    # g + lam * g * g * (params - backup), element by element:
    #  1 + 0.5*1*1*1 = 1.5;  -2 + 0.5*4*(-0.5) = -3;  0.5 + 0 = 0.5;  3 + 0.5*9*(-2) = -6
    assert torch.equal(out, torch.tensor([1.5, -3.0, 0.5, -6.0]))
    for t, c in zip((g, params, backup), copies):
        assert torch.equal(t, c)
    assert out.data_ptr() not in {t.data_ptr() for t in (g, params, backup)}
    assert torch.equal(dc_asgd(g, params, backup, 0.0), g)
    g_ro = readonly(g)
    assert torch.equal(dc_asgd(g_ro, params, backup, 0.5), out)
    with pytest.raises(ValueError):
        dc_asgd(g, params[:3], backup, 0.5)
