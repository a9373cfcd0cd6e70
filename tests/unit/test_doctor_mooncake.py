"""`doctor`'s Mooncake line (issue 52): importable or not, the transports, RDMA devices; no
engine needed (``mooncake.engine`` is stood in through ``sys.modules``)."""

from __future__ import annotations

import sys
import types

from sglang_hisparse.cli import doctor


def _engine(monkeypatch, **flags: bool) -> None:
    mod = types.ModuleType("mooncake.engine")
    mod.__dict__.update(flags)
    monkeypatch.setitem(sys.modules, "mooncake.engine", mod)


def test_missing_engine_warns_with_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import raises ImportError
    c = doctor.check_mooncake()
    assert c.status == doctor.WARN
    assert "not importable" in c.detail and "mooncake-transfer-engine-non-cuda" in c.detail
    assert "libibverbs1" in c.detail


def test_cpu_build_offers_tcp_and_rdma_only(monkeypatch, tmp_path):
    _engine(monkeypatch, SUPPORT_CUDA=False, SUPPORT_EFA=False, SUPPORT_INTRA_NVLINK=False)
    c = doctor.check_mooncake(rdma_dir=str(tmp_path / "absent"))
    assert c.status == doctor.OK
    assert "transports tcp, rdma;" in c.detail
    assert "RDMA devices: none (PD over it: MOONCAKE_PROTOCOL=tcp)" in c.detail


def test_gpu_build_lists_its_transports_and_devices(monkeypatch, tmp_path):
    _engine(monkeypatch, SUPPORT_CUDA=True, SUPPORT_INTRA_NVLINK=True, SUPPORT_MNNVL=False)
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    c = doctor.check_mooncake(rdma_dir=str(tmp_path))
    assert "transports tcp, rdma, cuda, nvlink;" in c.detail
    assert c.detail.endswith("RDMA devices: mlx5_0, mlx5_1")


def test_doctor_reports_the_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    from sglang_hisparse.cli.main import main

    main(["doctor", "--skip-hooks"])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if " mooncake " in ln)
    assert line.startswith("[warn]"), line
