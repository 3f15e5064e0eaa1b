"""Print a wheel's requirements without extras, one per line (for `pip install -r`): `make nemo-gym` installs
NeMo Gym's dependencies for this Python, then the wheel itself with `--no-deps --ignore-requires-python`.

    python scripts/wheel_requirements.py path/to/package.whl > requirements.txt
"""

import sys
import zipfile
from email.parser import Parser


def requirements(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(z.read(name).decode())
    return [r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r]


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1])))
