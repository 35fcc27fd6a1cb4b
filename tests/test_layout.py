"""Repository layout rules: `platform/` is never a package, and eagle/ stays free of platform code."""

import ast
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_IN_ENGINE = {"ray", "mlflow", "deepspeed", "fastapi", "starlette", "s3fs", "boto3", "botocore", "requests", "jobs", "serve", "eagle_platform"}


def test_platform_folder_is_not_a_package():
    assert (ROOT / "platform" / "eagle_platform" / "__init__.py").is_file()
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_import_platform_from_repo_root_is_the_standard_library():
    code = "import platform, uuid; print(platform.__file__); print(platform.python_version())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(out[0]).resolve().parent == stdlib
    assert out[1] == sys.version.split()[0]


def test_control_plane_package_imports_under_its_own_name():
    import eagle_platform

    assert Path(eagle_platform.__file__).resolve().parent == ROOT / "platform" / "eagle_platform"


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_engine_imports_only_torch_and_transformers_stack():
    offenders = {}
    for path in sorted((ROOT / "eagle").rglob("*.py")):
        bad = _top_level_imports(path) & FORBIDDEN_IN_ENGINE
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}
