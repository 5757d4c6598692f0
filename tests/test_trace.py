import pytest

from costmodel.trace import (
    CallRecord,
    DepthRecord,
    DepthTrace,
    TraceError,
    TraceHeader,
    read_call_trace,
    read_depth_trace,
    write_jsonl,
)


def header(kind="calls", **kw):
    return TraceHeader(trace=kind, source="measured", model="m", device="cpu", dtype="fp32",
                       depth=4, **kw)


def test_call_trace_round_trip(tmp_path):
    recs = [CallRecord(kind="block", positions=[5, 4], depths=[1, 3], contexts=[6, 5],
                       slots=[0, 2], wall_s=1e-3)]
    path = tmp_path / "t.jsonl"
    write_jsonl(path, header(), recs)
    h, back = read_call_trace(path)
    assert h.depth == 4 and back == recs
    assert back[0].slot_contexts() == {0: 6, 2: 5}
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_depth_trace_acceptance(tmp_path):
    recs = [DepthRecord(position=p, token=7, predictions=preds, top1_prob=[0.5] * 4)
            for p, preds in [(2, [1, 1, 1, 7]), (3, [7, 7, 7, 7]), (4, [1, 7, 7, 7])]]
    path = tmp_path / "d.jsonl"
    write_jsonl(path, header("depths", prompt_length=3), recs)
    trace = read_depth_trace(path)
    assert trace.acceptance_sequence(1) == [True, False]  # the prefill readout is skipped
    assert trace.acceptance(2) == 1.0
    assert isinstance(trace, DepthTrace)


@pytest.mark.parametrize("content", ["", "not json\n", '{"schema_version": 99}\n',
                                     '{"schema_version": 1, "trace": "calls"}\n',
                                     b"\x89PNG\r\n\x1a\n"])
def test_corrupt_traces_are_a_clear_error(tmp_path, content):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(TraceError):
        read_call_trace(path)


def test_bad_record_names_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, header(), [])
    path.write_text(path.read_text() + '{"kind": "block"}\n')
    with pytest.raises(TraceError, match="line 2"):
        read_call_trace(path)
    with pytest.raises(TraceError, match="not a depth trace"):
        read_depth_trace(path)


def test_a_depth_trace_with_a_position_read_out_short_is_refused(tmp_path):
    # predict and recommend raised an IndexError on it
    header = TraceHeader(trace="depths", source="measured", model="m", device="cpu",
                         dtype="fp32", depth=4, prompt_length=2)
    path = tmp_path / "short.jsonl"
    write_jsonl(path, header, [DepthRecord(position=2, token=1, predictions=[1, 1],
                                           top1_prob=[0.5, 0.5])])
    with pytest.raises(TraceError, match="position 2 is read out at 2 depths, not R = 4"):
        read_depth_trace(path)
