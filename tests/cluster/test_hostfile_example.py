"""hostfile.example is valid for Open MPI and, comments stripped as it says, for horovodrun."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOSTFILE = ROOT / "hostfile.example"


def entries():
    for line in HOSTFILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            yield line


def test_open_mpi_format():
    lines = list(entries())
    assert lines, "no hosts"
    for line in lines:
        assert re.fullmatch(r"[A-Za-z0-9._-]+(\s+(slots|max_slots)=\d+)*", line), line
    slots = sum(int(re.search(r"\bslots=(\d+)", l).group(1)) for l in lines)
    assert f"-np {slots} " in HOSTFILE.read_text()   # the example command uses every slot


def test_horovodrun_reads_it_once_comments_are_stripped(tmp_path):
    from horovod.runner.common.util.hosts import parse_host_files
    # the exact filter hostfile.example documents for horovodrun -hostfile
    cmd = r"grep -v -e '^#' -e '^$' hostfile.example | sed 's/ *#.*//'"
    stripped = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
    (tmp_path / "hosts").write_text(stripped)
    hosts = parse_host_files(str(tmp_path / "hosts"))
    assert hosts == "node1:2,node2:2,node3:1,gpu-old:1"
    assert f"-H {hosts} " in HOSTFILE.read_text()
