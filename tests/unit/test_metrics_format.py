from moetron.model.flops import mfu
from moetron.train.metrics import mfu_text


def test_unknown_gpu_peak_logs_no_mfu_number():
    assert mfu(50.0, None) is None
    assert mfu_text(mfu(50.0, None)) == "MFU n/a (--peak-tflops)"
    assert mfu_text(mfu(50.0, 200.0)) == "MFU 25.00%"
