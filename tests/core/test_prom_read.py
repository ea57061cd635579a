"""Reading /metrics text through prometheus_client's parser: selectors and info labels, on a
page written here in the exposition format vLLM serves."""

from __future__ import annotations

from kvops.core.prom import info_labels, samples_by_name, selector_sum

PAGE = """# HELP kvops_admission_decisions_total Admission decisions.
# TYPE kvops_admission_decisions_total counter
kvops_admission_decisions_total{decision="rejected",reason="queued_requests"} 3.0
kvops_admission_decisions_total{decision="admitted",reason="ok"} 5.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:num_preemptions_total{engine="1",model_name="m"} 1.0
# TYPE vllm:num_preemptions_total_x gauge
vllm:num_preemptions_total_x 100.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="100"} 1.0
"""


def test_a_bare_name_sums_every_labelled_sample_of_that_name_only():
    by_name = samples_by_name(PAGE)
    assert selector_sum(by_name, "vllm:num_preemptions_total") == 3.0  # not the _x gauge
    assert selector_sum(by_name, "kvops_admission_decisions_total") == 8.0


def test_a_selector_picks_the_samples_with_those_labels():
    by_name = samples_by_name(PAGE)
    selector = 'kvops_admission_decisions_total{decision="rejected",reason="queued_requests"}'
    assert selector_sum(by_name, selector) == 3.0
    assert selector_sum(by_name, 'vllm:num_preemptions_total{engine="1"}') == 1.0


def test_an_absent_metric_reads_zero():
    assert selector_sum(samples_by_name(PAGE), "vllm:nothing_total") == 0.0


def test_info_labels():
    by_name = samples_by_name(PAGE)
    assert info_labels(by_name, "vllm:cache_config_info") == {
        "block_size": "16", "cache_dtype": "auto", "num_gpu_blocks": "100"}
    assert info_labels(by_name, "vllm:absent_info") is None
