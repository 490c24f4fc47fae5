"""The example trainer's model and data pieces, in one process, without `unbroken.init()`."""

import importlib.util
import pathlib

import pytest
import torch

_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


@pytest.fixture(scope="module")
def train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt_under_test", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines things only: main() runs under __main__
    return module


@pytest.fixture(scope="module")
def data(train_gpt):
    return train_gpt.load_data()


@pytest.fixture
def one_thread():
    # The thread count changes float results; pin it as the script does, then restore.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _batch(train_gpt, tokens, step, rank, seed=1337):
    return train_gpt.get_batch(tokens, step, rank, seed=seed, batch_size=8, block_size=32)


def test_corpus_is_fixed_text_of_the_promised_size(train_gpt, data):
    tokens, vocab = data
    assert train_gpt.make_corpus() == train_gpt.make_corpus()
    assert 20_000 <= len(tokens) <= 50_000
    assert vocab == sorted(set(vocab)) and "\n" in vocab and " " in vocab
    assert tokens.dtype == torch.long and int(tokens.max()) == len(vocab) - 1


def test_batch_is_a_pure_function_of_seed_step_rank(train_gpt, data):
    tokens, _ = data
    torch.manual_seed(0)
    x1, y1 = _batch(train_gpt, tokens, step=5, rank=2)
    global_rng = torch.get_rng_state()
    x2, y2 = _batch(train_gpt, tokens, step=5, rank=2)
    assert torch.equal(global_rng, torch.get_rng_state())  # the global RNG is not touched
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == y1.shape == (8, 32)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one


def test_batches_differ_across_ranks_steps_and_seeds(train_gpt, data):
    tokens, _ = data
    base, _ = _batch(train_gpt, tokens, step=5, rank=2)
    for other in (dict(step=6, rank=2), dict(step=5, rank=3), dict(step=5, rank=2, seed=1)):
        x, _ = _batch(train_gpt, tokens, **other)
        assert not torch.equal(x, base), other
    seeds = {train_gpt.batch_seed(1337, step, rank) for step in range(100) for rank in range(8)}
    assert len(seeds) == 800


def test_same_seed_gives_bit_identical_models(train_gpt, data):
    cfg = train_gpt.GPTConfig(vocab_size=len(data[1]))
    torch.manual_seed(7)
    a = train_gpt.GPT(cfg)
    torch.manual_seed(7)
    b = train_gpt.GPT(cfg)
    torch.manual_seed(8)
    c = train_gpt.GPT(cfg)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_tied_embedding_and_head_are_one_parameter(train_gpt, data):
    model = train_gpt.GPT(train_gpt.GPTConfig(vocab_size=len(data[1])))
    assert model.transformer.wte.weight is model.lm_head.weight
    names = [name for name, _ in model.named_parameters()]
    assert len(names) == len(set(id(p) for p in model.parameters()))


def test_forward_shapes(train_gpt, data):
    tokens, vocab = data
    cfg = train_gpt.GPTConfig(vocab_size=len(vocab), block_size=16, n_layer=1, n_head=4, n_embd=32)
    model = train_gpt.GPT(cfg)
    x, y = train_gpt.get_batch(tokens, 0, 0, seed=0, batch_size=3, block_size=16)
    logits, loss = model(x, y)
    assert logits.shape == (3, 16, len(vocab))
    assert loss.shape == () and torch.isfinite(loss)
    logits, loss = model(x[:, :5])  # shorter than block_size, no targets
    assert logits.shape == (3, 5, len(vocab)) and loss is None
    with pytest.raises(ValueError, match="longer than block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_config_rejects_heads_that_do_not_divide_width(train_gpt):
    with pytest.raises(ValueError, match="multiple of n_head"):
        train_gpt.GPTConfig(vocab_size=10, n_embd=64, n_head=3)


def _train(train_gpt, tokens, vocab, steps, seed=1337):
    torch.manual_seed(seed)
    model = train_gpt.GPT(train_gpt.GPTConfig(vocab_size=len(vocab)))
    opt = train_gpt.build_optimizer(model, train_gpt.parse_args(["--optimizer", "plain"]), num_replicas=1)
    losses = []
    for step in range(steps):
        x, y = _batch(train_gpt, tokens, step, rank=0, seed=seed)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model, losses


def test_loss_decreases_with_plain_adamw(train_gpt, data, one_thread):
    tokens, vocab = data
    _, losses = _train(train_gpt, tokens, vocab, steps=30)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 3.3  # about ln(vocab size): an untrained model guesses uniformly
    assert last < first - 0.5, losses


def test_training_is_bit_reproducible(train_gpt, data, one_thread):
    tokens, vocab = data
    a, losses_a = _train(train_gpt, tokens, vocab, steps=5)
    b, losses_b = _train(train_gpt, tokens, vocab, steps=5)
    assert losses_a == losses_b
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name


def test_lr_schedule_warms_up_then_decays_to_min(train_gpt):
    f = lambda step: train_gpt.lr_multiplier(step, warmup_steps=10, total_steps=60)  # noqa: E731
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 70))


def test_num_replicas(train_gpt):
    assert train_gpt.resolve_num_replicas(2, 1) == 1
    assert train_gpt.resolve_num_replicas(2, 4) == 2
    assert train_gpt.resolve_num_replicas(4, 4) == 4
    with pytest.raises(ValueError, match="does not divide the world size 3"):
        train_gpt.resolve_num_replicas(2, 3)


def test_plain_optimizer_decays_matrices_only(train_gpt, data):
    model = train_gpt.GPT(train_gpt.GPTConfig(vocab_size=len(data[1])))
    opt = train_gpt.build_optimizer(model, train_gpt.parse_args(["--optimizer", "plain"]), num_replicas=1)
    assert isinstance(opt, torch.optim.AdamW)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


class _FakeJob:
    """Stands in for `unbroken.Job` in the plain path: `world_size` ranks that all hold the
    same gradients, so the summed buffer is `world_size` times each rank's own."""

    def __init__(self, world_size):
        self.world_size = self.data_world_size = world_size  # (data_world_size: the job never shrank)
        self.reduced = []

    def all_reduce(self, tensor):
        self.reduced.append(tensor.numel())
        return tensor.mul_(self.world_size)


def test_all_reduce_gradients_averages_through_one_flat_buffer(train_gpt):
    params = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(5))]
    for i, p in enumerate(params):
        p.grad = torch.arange(p.numel(), dtype=torch.float32).view_as(p) + 10 * i
    expected = [p.grad.clone() for p in params]
    job = _FakeJob(world_size=4)
    train_gpt.all_reduce_gradients(params, job)
    assert job.reduced == [11]  # one collective over all 6 + 5 elements
    for p, e in zip(params, expected):  # the average of identical gradients is the gradient
        assert torch.equal(p.grad, e)


def test_save_weights_unties_and_replaces_atomically(train_gpt, data, tmp_path):
    from safetensors.torch import load_file

    model = train_gpt.GPT(train_gpt.GPTConfig(vocab_size=len(data[1])))
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"old")
    train_gpt.save_weights(model, str(path))
    loaded = load_file(str(path))
    assert set(loaded) == set(model.state_dict())
    assert torch.equal(loaded["lm_head.weight"], loaded["transformer.wte.weight"])
    assert not (tmp_path / "w.safetensors.tmp").exists()


def test_parse_args_defaults_and_checks(train_gpt):
    args = train_gpt.parse_args([])
    assert (args.steps, args.optimizer, args.num_replicas, args.step_sleep_s, args.out) == (
        60, "sharded", 2, 0.0, None)
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--n-embd", "64", "--n-head", "3"])
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--num-replicas", "0"])
