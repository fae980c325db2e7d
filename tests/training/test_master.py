"""bf16 weights with fp32 master copies (training/speed/master.py): updates far below bf16's resolution still add up."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from training.speed.master import MasterAdamW


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).to(torch.bfloat16)


def _steps(opt, model, n, x):
    for _ in range(n):
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


def test_small_updates_accumulate_in_the_masters_and_reach_the_bf16_weights():
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    named = list(model.named_parameters())
    opt = MasterAdamW(named, no_decay=set(), lr=1e-4, weight_decay=0.0)
    x = torch.randn(16, 8, dtype=torch.bfloat16)
    _steps(opt, model, 1, x)
    # one step of 1e-4 is below bf16's resolution near these weights: the bf16 weights may not move, the masters do
    moved = [(m - s.float()).abs().max().item() for m, s in zip(opt.masters, start)]
    assert all(0 < d < 2e-4 for d in moved), moved
    _steps(opt, model, 199, x)
    for p, m, s in zip(model.parameters(), opt.masters, start):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert torch.equal(p, m.to(torch.bfloat16))  # the model holds its master rounded
        assert (m - s.float()).abs().max() > 5e-3  # 200 steps of ~1e-4 add up to far more than one bf16 step

    # plain AdamW on the bf16 weights themselves loses them: most weights never leave their start
    plain = _model()
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.0)
    _steps(popt, plain, 200, x)
    stuck = sum(int((p == s).sum()) for p, s in zip(plain.parameters(), start))
    kept = sum(int((p == s).sum()) for p, s in zip(model.parameters(), start))
    assert stuck > kept


def test_no_decay_names_and_the_schedulers_learning_rate_reach_the_masters():
    model = _model()
    named = list(model.named_parameters())
    opt = MasterAdamW(named, no_decay={"0.bias", "1.weight", "1.bias"}, lr=1e-3, weight_decay=0.5)
    assert [len(g["params"]) for g in opt.param_groups] == [1, 3]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.1)
    opt.step()  # no gradients yet: nothing moves
    sched.step()
    assert all(g["lr"] == pytest.approx(1e-4) for g in opt.param_groups)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_a_resumed_optimizer_steps_on_from_the_saved_masters_exactly(tmp_path):
    x = torch.randn(16, 8, dtype=torch.bfloat16)
    model = _model()
    opt = MasterAdamW(list(model.named_parameters()), no_decay=set(), lr=1e-4, weight_decay=0.0)
    _steps(opt, model, 3, x)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    _steps(opt, model, 2, x)  # the run that was not interrupted

    # as the Trainer resumes: a fresh model and optimizer, then the checkpoint's weights, then its optimizer state
    again = _model()
    ropt = MasterAdamW(list(again.named_parameters()), no_decay=set(), lr=1e-4, weight_decay=0.0)
    again.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    ropt.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    _steps(ropt, again, 2, x)
    assert all(torch.equal(a, b) for a, b in zip(ropt.masters, opt.masters))
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters()))


def test_a_checkpoint_without_masters_starts_them_from_the_loaded_weights_and_to_fp32_gives_the_masters():
    x = torch.randn(16, 8, dtype=torch.bfloat16)
    trained = _model()
    plain = torch.optim.AdamW(trained.parameters(), lr=1e-3)  # an autocast-style optimizer's state: no masters
    _steps(plain, trained, 3, x)
    model = _model()
    opt = MasterAdamW(list(model.named_parameters()), no_decay=set(), lr=1e-4, weight_decay=0.0)
    model.load_state_dict(trained.state_dict())
    opt.load_state_dict(plain.state_dict())
    assert all(torch.equal(m, p.float()) for m, p in zip(opt.masters, trained.parameters()))
    _steps(opt, model, 2, x)
    opt.to_fp32(model)
    assert all(p.dtype == torch.float32 and torch.equal(p, m) for p, m in zip(model.parameters(), opt.masters))


def _clipped_reference(model, max_norm, lr=1e-3):
    """torch's own recipe on fp32 copies of model's weights and bf16 gradients: clip_grad_norm_ (each weight's
    norm taken of the bf16 gradient itself, as the Trainer's clip of bf16 gradients does), then fused AdamW."""
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]).float())
    for r, p in zip(ref, model.parameters()):
        r.grad = p.grad.float()
    exact = torch.nn.utils.get_total_norm([r.grad for r in ref])
    torch.nn.utils.clip_grads_with_norm_(ref, max_norm, norm)
    torch.optim.AdamW(ref, lr=lr, weight_decay=0.0, fused=True).step()
    return ref, norm, exact


@pytest.mark.parametrize("max_norm", [1e-3, 1e3])  # clipped hard, and not at all
def test_its_clip_steps_as_torchs_clip_then_adamw_would(max_norm):
    model = _model()
    opt = MasterAdamW(list(model.named_parameters()), no_decay=set(), lr=1e-3, weight_decay=0.0, fused=True)
    model(torch.randn(16, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    ref, ref_norm, exact = _clipped_reference(model, max_norm)
    norm = opt.clip_grad_norm(max_norm)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(ref_norm.item(), rel=1e-6)
    assert norm.item() == pytest.approx(exact.item(), rel=1e-2)  # each weight's norm rounded to bf16, no more
    opt.step()
    for m, r in zip(opt.masters, ref):
        torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-7)
    assert opt.grad_scale is None  # the factor is for that one step only


def test_the_trainer_clips_and_logs_its_grad_norm_through_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    from training.speed import master

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, x, labels):
            return {"loss": (self.lin(x.to(self.lin.weight.dtype)).float().squeeze(-1) - labels).pow(2).mean()}

    torch.manual_seed(0)
    data = [{"x": torch.randn(8), "labels": torch.tensor(5.0)} for _ in range(8)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                                          logging_steps=1, max_grad_norm=0.5, learning_rate=1e-3, report_to=[],
                                          save_strategy="no", use_cpu=True)
    model, optimizers = master.bf16_master(Tiny(), args, ["lin.weight"])
    opt = optimizers[0]
    norms = []
    clip = opt.clip_grad_norm
    opt.clip_grad_norm = lambda max_norm: norms.append((max_norm, clip(max_norm))) or norms[-1][1]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=optimizers)
    assert master.attach(trainer, optimizers)
    trainer.train()
    assert [m for m, _ in norms] == [0.5, 0.5]  # once a step, with the run's max_grad_norm
    logged = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    assert logged == pytest.approx([n.item() for _, n in norms]) and all(n > 0.5 for n in logged)


def _twin_models():
    """Two equal bf16 models whose weights have sizes both on and off the 16-wide vectors' grid."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.GELU(), torch.nn.Linear(48, 5),
                                   torch.nn.LayerNorm(5)).to(torch.bfloat16)
    return build(), build()


def test_the_native_step_is_torchs_fused_adamw_bit_for_bit_and_their_checkpoints_interchange():
    """training/speed/native's one-pass step against torch's path (copy the gradients to fp32, fused AdamW, copy
    back): the same masters, weights and moments, through weight decay, a clip factor, a weight without a
    gradient and a scheduler's learning rate; and either one resumes the other's state_dict."""
    import shutil

    if shutil.which("gcc") is None:
        pytest.skip("no gcc on this machine: the native kernels are not built (torch's path runs instead)")
    a_model, b_model = _twin_models()
    make = lambda model: MasterAdamW(list(model.named_parameters()), no_decay={"3.weight", "3.bias"}, lr=1e-2,
                                     weight_decay=0.1, fused=True)
    a, b = make(a_model), make(b_model)
    b._native = False
    sched = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (a, b)]
    x = torch.randn(32, 64, dtype=torch.bfloat16)

    def step(opt, model, i, clip):
        opt.zero_grad()
        model(x * (i + 1)).float().pow(2).mean().backward()
        if i == 2:
            model[0].bias.grad = None  # not stepped this time: its step count stays behind
        if clip:
            opt.clip_grad_norm(1e-3)
        opt.step()

    for i in range(5):
        for opt, model, s in ((a, a_model, sched[0]), (b, b_model, sched[1])):
            step(opt, model, i, clip=i == 1)
            s.step()
    assert a._native and not b._native  # the kernels were built and stepped a
    sa, sb = a.state_dict(), b.state_dict()
    assert torch.equal(sa["fp32_masters"], sb["fp32_masters"])
    for p, q in zip(a_model.parameters(), b_model.parameters()):
        assert torch.equal(p, q)
    for i, st in sb["state"].items():
        assert torch.equal(sa["state"][i]["step"], st["step"])
        torch.testing.assert_close(sa["state"][i]["exp_avg"], st["exp_avg"], rtol=0, atol=0)
        # torch's own scalar loop for the last few elements of a weight rounds c2 * g * g once more
        torch.testing.assert_close(sa["state"][i]["exp_avg_sq"], st["exp_avg_sq"], rtol=2e-7, atol=0)
    assert sa["state"][1]["step"].item() == 4  # the bias without a gradient in one step

    # each resumes the other's checkpoint and the two go on equal
    c_model, d_model = _twin_models()
    c, d = make(c_model), make(d_model)
    d._native = False
    c_model.load_state_dict(b_model.state_dict())
    d_model.load_state_dict(a_model.state_dict())
    c.load_state_dict(sb)
    d.load_state_dict(sa)
    for opt, model in ((c, c_model), (d, d_model)):
        step(opt, model, 5, clip=False)
    assert torch.equal(c.state_dict()["fp32_masters"], d.state_dict()["fp32_masters"])
    assert all(torch.equal(p, q) for p, q in zip(c_model.parameters(), d_model.parameters()))


def test_without_gcc_or_turned_off_the_step_is_torchs_and_says_why(tmp_path, monkeypatch, caplog):
    from training.speed import native

    model = _model()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc on it
    native.reset()
    try:
        with caplog.at_level("WARNING", logger="training.speed.native"):
            assert native.lib() is None
        assert "native kernels unavailable (gcc not found)" in caplog.text and "install gcc" in caplog.text
        opt = MasterAdamW(list(model.named_parameters()), no_decay=set(), lr=1e-3, weight_decay=0.0, fused=True)
        before = [m.clone() for m in opt.masters]
        _steps(opt, model, 1, torch.randn(4, 8, dtype=torch.bfloat16))
        assert opt._native is False and any(not torch.equal(m, s) for m, s in zip(opt.masters, before))

        monkeypatch.undo()
        monkeypatch.setenv(native.ENV, "0")
        native.reset()
        assert native.lib() is None
    finally:
        native.reset()


def test_the_kernels_build_once_per_source_compiler_and_cpu(tmp_path, monkeypatch):
    import shutil

    from training.speed import native

    if shutil.which("gcc") is None:
        pytest.skip("no gcc on this machine")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = native.build()
    assert first.parent == tmp_path / "xeon-cluster" / "kernels" and first.stat().st_size > 0
    stamp = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == stamp  # cached: not built again
    changed = tmp_path / "kernels.c"
    changed.write_text(native.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(native, "SOURCE", changed)
    assert native.build() != first  # another source, another library
    assert not list(first.parent.glob("*.tmp"))  # no half-written file left beside them


def test_groups_with_their_own_betas_step_on_torchs_path():
    model = _model()
    opt = MasterAdamW(list(model.named_parameters()), no_decay={"1.weight", "1.bias"}, lr=1e-3, weight_decay=0.1,
                      fused=True)
    opt.param_groups[1]["betas"] = (0.8, 0.99)  # the native kernel takes one pair for every tensor
    _steps(opt, model, 1, torch.randn(4, 8, dtype=torch.bfloat16))
    assert opt._native is False
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(model.parameters(), opt.masters))


def test_the_native_clip_norm_is_foreach_norms_per_weight_rounding_and_all():
    """clip_grad_norm's one native pass: each weight's norm as torch._foreach_norm gives it for bf16 gradients
    (fp32 sums, rounded to bf16), through weights of several chunks, odd sizes and one without a gradient."""
    import shutil

    if shutil.which("gcc") is None:
        pytest.skip("no gcc on this machine: the native kernels are not built (torch's path runs instead)")
    torch.manual_seed(0)
    shapes = [(3 * 65536 + 7,), (1000, 77), (5,), (300, 300)]  # several 64k-element chunks, and less than one
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in shapes]
    opt = MasterAdamW([(f"w{i}", p) for i, p in enumerate(params)], no_decay=set(), lr=1e-3, weight_decay=0.0)
    for i, p in enumerate(params):
        p.grad = None if i == 2 else (torch.randn(p.shape) * (i + 1)).to(torch.bfloat16)
    native_norms = opt._native_norms()
    assert native_norms is not None and opt._native  # the kernel ran
    want = torch.stack(torch._foreach_norm([p.grad for p in params if p.grad is not None], 2))
    assert native_norms.dtype == want.dtype == torch.bfloat16
    assert torch.equal(native_norms, want)
    assert opt.clip_grad_norm(1.0).item() == pytest.approx(torch.linalg.vector_norm(want.float()).item(), rel=1e-6)
    params[1].grad = torch.randn(77, 1000).bfloat16().t()  # not contiguous: torch's path
    assert opt._native_norms() is None


def test_speed_apply_installs_the_encoder_levers_and_reports_them(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from training.speed import fastdrop, speedup
    from training.speed.levers import SpeedArguments

    monkeypatch.delenv("XC_RESUME_FROM", raising=False)
    monkeypatch.delenv("XC_RESUME_URL", raising=False)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, num_labels=2)
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, report_to=[], do_train=True)
    seen = []
    fast = speedup.apply(model, SpeedArguments(), args, [], transformers.Trainer,
                       lambda m: seen.append(m) or (m, (None, None)))
    assert seen == [model]  # the job's own optimizers (IPEX's) see the model after the levers, before the masters
    assert fast.applied == {"fast_dropout": True, "freeze_embeddings": True, "bf16_weights": True,
                            "attn_implementation": model.config._attn_implementation}
    assert isinstance(fast.optimizers[0], MasterAdamW) and fast.model.dtype == torch.bfloat16
    assert not fast.model.get_input_embeddings().weight.requires_grad
    assert not any(type(m) is torch.nn.Dropout for m in fast.model.modules())
    assert any(isinstance(m, fastdrop.FastDropout) for m in fast.model.modules())
    fast.finish()
    assert fast.model.dtype == torch.float32  # the fp32 masters, for the saved model
    plain = speedup.apply(transformers.AutoModelForSequenceClassification.from_config(config),
                        SpeedArguments(fast_dropout=False, freeze_embeddings=False, bf16_weights="False"),
                        transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]), [],
                        transformers.Trainer)
    assert plain.optimizers == (None, None) and plain.applied["bf16_weights"] is False
    assert plain.model.get_input_embeddings().weight.requires_grad
