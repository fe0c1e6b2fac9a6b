"""Serving's optional mechanisms against hand-solved schedules: preemption by swap over PCIe
(`preemption="swap"`), prefix caching by `prefix_id` (`prefix_caching=True`), and the run's
energy and cost. Each expected number is computed from the engine's own step times."""

from __future__ import annotations

import json

import pytest

from sim.runs import DecodeRequest, ServeRequest, run
from sim.runs.bind import resolve_pod, simulate_step
from sim.serving.costs import StepModel
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from workloads.inference import DecodeConfig
from workloads.models import MlpKind, TransformerSpec

TINY = TransformerSpec(name="serve-tiny", num_layers=2, d_model=1024, num_heads=8,
                       num_kv_heads=8, head_dim=128, d_ff=4096, mlp=MlpKind.SWIGLU,
                       vocab_size=8192)
POD = {"model": TINY, "chip": "v5e", "shape": "2x2", "mesh": "tensor=4"}


def _trace(tmp_path, rows, prefix=False):
    p = tmp_path / "t.csv"
    head = "arrival_s,prompt_tokens,output_tokens" + (",prefix_id" if prefix else "")
    p.write_text(head + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return str(p)


def _serve(**kw):
    return run(ServeRequest(**POD, **kw))


def _step():
    req = DecodeRequest(**POD, batch=1, context_len=1)
    pod = resolve_pod(req)
    return StepModel(chip=pod.chip, topology=pod.topology, model=TINY,
                     mesh=parse_mesh("tensor=4", None),
                     config=DecodeConfig(batch=1, context_len=1),
                     simulate=lambda tr: simulate_step(req, tr, pod.chip, pod.topology))


def _hbm_for(step, tokens: int) -> str:
    """An HBM size leaving exactly `tokens` cached tokens after weights and working memory."""
    plan = step.kv_capacity_tokens(2)[1]
    per_token = plan["kv_bytes_per_token"] / 4  # per chip
    return repr(plan["weights_bytes"] + plan["activation_bytes"] + tokens * per_token + 1)


# -- preemption by swap -------------------------------------------------------------------------
def test_swap_preemption_copies_the_cache_out_and_back_instead_of_recomputing(tmp_path):
    # 6 blocks of 16: A and B (40-token prompts, 20 tokens) are prefilled together (3 blocks
    # each) and join at iteration 1 with 40 cached. At iteration 9 both need a 4th block: B
    # (newest) is preempted with 9 tokens made, 48 cached, which go to host memory in that
    # iteration (A decodes alone: decode(1, 48) + the copy). A ends at iteration 19; iteration
    # 20 copies B's 48 tokens back (nothing else runs); B decodes tokens 10..20 from 21 on.
    step = _step()
    rows = [(0.0, 40, 20), (0.0, 40, 20)]
    kw = dict(arrival="trace", trace=_trace(tmp_path, rows),
              overrides={"hbm_bytes": _hbm_for(step, 96)}, max_batch=2, exact_costs=True)
    swap = _serve(preemption="swap", **kw)
    recompute = _serve(**kw)
    chip = resolve_pod(DecodeRequest(**POD, batch=1, context_len=1)).chip
    per_token = swap.summary["pools"][0]["kv_bytes_per_token"]
    copy_s = 48 * per_token / (4 * chip.pcie_bytes_per_s)
    its = swap.result.iterations_frame()
    assert swap.summary["pools"][0]["kv_blocks"] == 6
    assert swap.summary["preemptions"] == 1 and swap.summary["preemption"] == "swap"
    assert its.swap_tokens.tolist() == [0] * 9 + [48] + [0] * 10 + [48] + [0] * 11
    assert its.duration_s[9] == pytest.approx(step.decode_s(1, 48) + copy_s, rel=1e-9)
    assert its.duration_s[20] == pytest.approx(copy_s, rel=1e-12)
    assert its.decode_batch[20] == 0 and its.prefill_tokens[20] == 0
    # Only the two first prefills: nothing is recomputed.
    assert its.prefill_tokens.sum() == 80
    assert recompute.result.iterations_frame().prefill_tokens.sum() > 80
    assert swap.summary["swap_tokens"] == 96
    req = swap.result.requests_frame()
    assert req.preemptions.tolist() == [0, 1]
    assert float(req.finish_s[1]) == pytest.approx(float(its.start_s.iloc[-1]
                                                         + its.duration_s.iloc[-1]), rel=1e-12)
    # Every token once: A's 19 decode steps (B in 8 of them), then B's last 11.
    assert (its.decode_batch > 0).sum() == 19 + 11
    assert its.decode_batch.sum() == 19 + 8 + 11


def test_an_unknown_preemption_policy_is_one_line_naming_the_choices():
    with pytest.raises(TpusimError, match="'evict' does not exist.*recompute, swap|swap") as e:
        _serve(rate=1, requests=2, prompt_tokens="fixed:16", output_tokens="fixed:2",
               preemption="evict")
    assert "\n" not in str(e.value)


def test_default_runs_record_no_new_settings():
    r = _serve(rate=50, requests=10, prompt_tokens="fixed:16", output_tokens="fixed:3")
    assert "preemption" not in json.dumps(r.inputs.get("request", {}))


# -- prefix caching -----------------------------------------------------------------------------
def test_a_cached_prefix_is_not_prefilled_again(tmp_path):
    # A (100-token prompt, a 64-token prefix 7) runs alone and leaves its prefix's 4 blocks
    # cached; B (80 tokens, the same prefix) comes when the replica is idle and prefills only
    # its last 16 tokens, after 64 cached: TTFT = prefill(16 after 64). Its blocks: the 4
    # shared plus 1 of its own.
    e = _step()
    rows = [(0.0, 100, 2, 7, 64), (1.0, 80, 2, 7, 64)]
    tr = tmp_path / "t.csv"
    tr.write_text("arrival_s,prompt_tokens,output_tokens,prefix_id,prefix_tokens\n"
                  + "".join(",".join(map(str, r)) + "\n" for r in rows))
    on = _serve(arrival="trace", trace=str(tr), exact_costs=True, prefix_caching=True)
    off = _serve(arrival="trace", trace=str(tr), exact_costs=True)
    req_on, req_off = on.result.requests_frame(), off.result.requests_frame()
    assert float(req_on.ttft_s[1]) == pytest.approx(e.prefill_s(16, 64), rel=1e-9)
    assert float(req_off.ttft_s[1]) == pytest.approx(e.prefill_s(80, 0), rel=1e-9)
    assert float(req_on.ttft_s[0]) == float(req_off.ttft_s[0])
    assert on.summary["prefix_hit_tokens"] == 64 and off.summary["prefix_hit_tokens"] == 0
    its = on.result.iterations_frame()
    b_prefill = its[its.start_s >= 1.0].iloc[0]
    assert b_prefill.prefill_tokens == 16 and b_prefill.kv_blocks_used == 4 + 1


def test_without_prefix_tokens_a_prefix_is_the_first_prompt_of_its_id_in_whole_blocks(
        tmp_path):
    # A's 50-token prompt is prefix 3: whole blocks leaving A's last token, 48 tokens. B (70
    # tokens) shares 48 and prefills 22 after them.
    e = _step()
    r = _serve(arrival="trace", trace=_trace(tmp_path, [(0.0, 50, 2, 3), (1.0, 70, 2, 3)],
                                             prefix=True),
               exact_costs=True, prefix_caching=True)
    assert r.summary["prefix_hit_tokens"] == 48
    assert float(r.result.requests_frame().ttft_s[1]) == pytest.approx(e.prefill_s(22, 48),
                                                                       rel=1e-9)


def test_unused_cached_prefixes_are_evicted_least_recently_used_first(tmp_path):
    # 6 blocks of 16. A (prefix 1) and B (prefix 2), 40-token prompts, each leave 2 blocks
    # cached (32 tokens). C (60 tokens, no prefix) needs 4 of the 2 free: prefix 1, the least
    # recently used, is evicted. E (prefix 2) then hits 32 tokens; F (prefix 1) misses.
    e = _step()
    rows = [(0.0, 40, 2, 1), (1.0, 40, 2, 2), (2.0, 60, 2, ""), (3.0, 40, 2, 2),
            (4.0, 40, 2, 1)]
    r = _serve(arrival="trace", trace=_trace(tmp_path, rows, prefix=True), exact_costs=True,
               prefix_caching=True, overrides={"hbm_bytes": _hbm_for(e, 96)}, max_batch=2)
    assert r.summary["pools"][0]["kv_blocks"] == 6
    assert r.summary["prefix_hit_tokens"] == 32 and r.summary["preemptions"] == 0
    ttft = r.result.requests_frame().ttft_s.tolist()
    assert ttft[3] == pytest.approx(e.prefill_s(8, 32), rel=1e-9)
    assert ttft[4] == pytest.approx(e.prefill_s(40, 0), rel=1e-9)
    assert r.result.iterations_frame().kv_blocks_used.max() <= 6


def test_prefix_caching_with_static_batching_or_a_bad_prefix_column_is_refused(tmp_path):
    with pytest.raises(TpusimError, match="continuous"):
        _serve(rate=1, requests=2, prompt_tokens="fixed:16", output_tokens="fixed:2",
               scheduler="static", prefix_caching=True)
    tr = tmp_path / "bad.csv"
    tr.write_text("arrival_s,prompt_tokens,output_tokens,prefix_id,prefix_tokens\n0,10,2,1,x\n")
    with pytest.raises(TpusimError, match="line 2: prefix_tokens 'x'") as e:
        _serve(arrival="trace", trace=str(tr), prefix_caching=True)
    assert "\n" not in str(e.value)


# -- energy and cost ----------------------------------------------------------------------------
def _energy_step():
    from sim.runs.train import step_energy_of

    req = DecodeRequest(**POD, batch=1, context_len=1)
    pod = resolve_pod(req)
    return StepModel(chip=pod.chip, topology=pod.topology, model=TINY,
                     mesh=parse_mesh("tensor=4", None),
                     config=DecodeConfig(batch=1, context_len=1),
                     simulate=lambda tr: simulate_step(req, tr, pod.chip, pod.topology),
                     energy=lambda tr, r: step_energy_of(tr, pod.topology, None)(r, pod.chip)
                     ), pod.chip


def _chip_j(units):
    return sum(units[u] for u in ("mxu", "vpu", "hbm", "ici", "dcn", "pcie", "static"))


def test_one_request_alone_uses_its_steps_joules_plus_idle_power_over_the_span(tmp_path):
    # P = 64, O = 4: a prefill of 64, then decodes at contexts 64, 65, 66. Its dynamic joules
    # are those steps' engine joules; static is idle power x 4 chips x the span; host and
    # overhead are the chip's multipliers on those.
    e, chip = _energy_step()
    r = _serve(arrival="trace", trace=_trace(tmp_path, [(0.0, 64, 4)]), exact_costs=True)
    en = r.summary["energy"]
    steps = [e.prefill_joules(64, 0)] + [e.decode_joules(1, c) for c in (64, 65, 66)]
    for k, unit in enumerate(("mxu", "vpu", "hbm", "ici", "dcn", "pcie")):
        assert en["energy_j_by_unit"][unit] == pytest.approx(sum(s[k] for s in steps),
                                                             rel=1e-9, abs=1e-12)
    span = r.summary["span_s"]
    assert en["energy_j_by_unit"]["static"] == pytest.approx(chip.idle_power_w * 4 * span,
                                                             rel=1e-12)
    chip_j = _chip_j(en["energy_j_by_unit"])
    host = chip.host_power_share * chip_j
    assert en["energy_j_by_unit"]["host"] == pytest.approx(host, rel=1e-12)
    assert en["energy_j_by_unit"]["overhead"] == pytest.approx((chip.pue - 1) * (chip_j + host),
                                                               rel=1e-12)
    # Units sum to the total; per token over the output tokens; power over the span.
    assert en["energy_j"] == pytest.approx(sum(en["energy_j_by_unit"].values()), rel=1e-12)
    assert en["j_per_token"] == pytest.approx(en["energy_j"] / 4, rel=1e-12)
    assert en["chip_power_w_mean"] == pytest.approx(chip_j / (4 * span), rel=1e-12)
    assert chip.idle_power_w < en["chip_power_w_mean"] <= en["chip_power_w_peak"]
    c = r.summary["cost"]
    assert c["usd_per_hour"] == pytest.approx(4 * chip.usd_per_chip_hour, rel=1e-12)
    assert c["usd_total"] == pytest.approx(c["usd_per_hour"] * span / 3600, rel=1e-12)
    assert c["usd_per_million_tokens"] == pytest.approx(c["usd_total"] / 4 * 1e6, rel=1e-12)


def test_energy_adds_over_requests_and_replicas(tmp_path):
    # Requests a second apart each run alone: twice the requests is twice the dynamic joules;
    # two replicas serving the same requests (one each) use the same dynamic joules and twice
    # the static power over about the same span.
    one = [(0.0, 64, 4)]
    two = [(0.0, 64, 4), (1.0, 64, 4)]
    dyn = ("mxu", "vpu", "hbm", "ici")
    a = _serve(arrival="trace", trace=_trace(tmp_path, one), exact_costs=True)
    b = _serve(arrival="trace", trace=_trace(tmp_path, two), exact_costs=True)
    c = _serve(arrival="trace", trace=_trace(tmp_path, two), exact_costs=True, replicas=2)
    ua, ub, uc = (x.summary["energy"]["energy_j_by_unit"] for x in (a, b, c))
    for u in dyn:
        assert ub[u] == pytest.approx(2 * ua[u], rel=1e-12)
        assert uc[u] == pytest.approx(ub[u], rel=1e-12)
    assert uc["static"] / c.summary["span_s"] == pytest.approx(
        2 * ub["static"] / b.summary["span_s"], rel=1e-12)
    # Pools sum to the run (disaggregated: the KV transfer's DCN joules on the prefill pool).
    d = _serve(arrival="trace", trace=_trace(tmp_path, two), exact_costs=True,
               prefill_replicas=1, decode_replicas=1)
    en = d.summary["energy"]
    for u, v in en["energy_j_by_unit"].items():
        assert v == pytest.approx(sum(p["energy_j_by_unit"][u] for p in en["by_pool"]),
                                  rel=1e-12, abs=1e-15)
    chip = resolve_pod(DecodeRequest(**POD, batch=1, context_len=1)).chip
    prefill_pool = en["by_pool"][0]
    assert prefill_pool["role"] == "prefill"
    # A serving run's step is an iteration: per-step figures times the iterations are the run's.
    n = len(d.result.iterations)
    assert en["step_j"] * n == pytest.approx(en["energy_j"], rel=1e-12)
    assert sum(en["step_j_by_unit"].values()) == pytest.approx(en["step_j"], rel=1e-12)
    assert d.summary["cost"]["usd_per_step"] * n == pytest.approx(d.summary["cost"]["usd_total"],
                                                                  rel=1e-12)
    assert prefill_pool["energy_j_by_unit"]["dcn"] == pytest.approx(
        2 * TINY.kv_cache_bytes(64, 2) * chip.dcn_j_per_byte, rel=1e-12)


def test_the_cost_models_energy_is_within_one_percent_of_the_engines():
    kw = dict(rate=300, requests=120, prompt_tokens="uniform:20,400",
              output_tokens="uniform:2,30", seed=11)
    grid, exact = _serve(**kw), _serve(exact_costs=True, **kw)
    g, x = grid.summary["energy"], exact.summary["energy"]
    for u in ("mxu", "hbm"):
        assert g["energy_j_by_unit"][u] == pytest.approx(x["energy_j_by_unit"][u], rel=0.01)
    assert g["energy_j"] == pytest.approx(x["energy_j"], rel=0.01)


def test_swapped_bytes_cost_pcie_joules(tmp_path):
    step = _step()
    r = _serve(arrival="trace", trace=_trace(tmp_path, [(0.0, 40, 20), (0.0, 40, 20)]),
               overrides={"hbm_bytes": _hbm_for(step, 96)}, max_batch=2, exact_costs=True,
               preemption="swap")
    chip = resolve_pod(DecodeRequest(**POD, batch=1, context_len=1)).chip
    nbytes = 96 * r.summary["pools"][0]["kv_bytes_per_token"]
    assert r.summary["energy"]["energy_j_by_unit"]["pcie"] == pytest.approx(
        nbytes * chip.pcie_j_per_byte, rel=1e-12)


@pytest.mark.parametrize("extra,want", [
    (["--preemption", "evict"], "tpusim: error: --preemption 'evict' does not exist"),
    (["--scheduler", "static", "--prefix-caching"],
     "tpusim: error: --prefix-caching shares cached prompt prefixes between the requests of "
     "continuous batching; use --scheduler continuous or drop it"),
])
def test_cli_errors_spell_the_new_settings_as_flags(capsys, extra, want):
    from sim.cli import main

    code = main(["serve", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--mesh",
                 "tensor=4", "--rate", "5", "--requests", "3", "--prompt-tokens", "fixed:32",
                 "--output-tokens", "fixed:2", *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(want) and err.count("\n") == 1


def test_a_serving_rate_sweep_draws_its_knee_with_saturated_points_off_the_lines(tmp_path):
    # A 2-layer model on one 2x2 v5e replica: 20/s and 200/s are served; a burst of 400
    # requests at 10^6/s is past what it serves (more than 4 batches left waiting when the last
    # arrives: saturated).
    import sim
    from sim.studies.plots import KNEE_FILE, knee_lines
    from sim.studies.spec import load_study

    study = {"command": "serve",
             "base": {"model": "llama3-8b", "chip": "v5e", "shape": "2x2", "mesh": "tensor=4",
                      "requests": 400, "prompt-tokens": "fixed:128", "output-tokens": "fixed:8",
                      "set.model.num_layers": 2},
             "grid": {"rate": [20, 200, 1000000], "max-batch": [4, 16]},
             "metrics": ["ttft_s.p99", "tpot_s.p99", "throughput_tokens_per_s"]}
    df = sim.sweep(study, out=tmp_path / "o", quiet=True)
    assert (tmp_path / "o" / KNEE_FILE).stat().st_size > 0
    lines = knee_lines(load_study(study), df)
    assert [label for label, *_ in lines] == ["max-batch=4", "max-batch=16"]
    for _label, points, line, sat in lines:
        assert list(points["rate"]) == [20, 200, 1000000]
        assert list(sat["rate"]) == [1000000] and 1000000 not in list(line["rate"])
        assert not line["saturated"].any() and sat["saturated"].all()
    # A serving study that does not vary the rate draws no knee.
    assert knee_lines(load_study({**study, "grid": {"max-batch": [4, 16]}}), df) == []
