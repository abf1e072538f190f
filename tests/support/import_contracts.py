"""An import-linter contract for the compiled extension.

grimp builds its graph from source files, so it cannot see ``fastckpt._C`` (a
shared object): an import of it is recorded as an import of its package, with
the importing line. This contract reads those lines and fails where a module
outside ``allowed`` imports the extension.
"""

import re

from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck
from importlinter.application import output


class ExtensionContract(Contract):
    type_name = "extension"

    extension = fields.StringField()
    allowed = fields.ListField(subfield=fields.StringField())

    def check(self, graph, verbose: bool) -> ContractCheck:
        package, name = self.extension.rsplit(".", 1)
        # `from . import _C`, `from fastckpt import _C`, `import fastckpt._C`, `from fastckpt._C import x`
        pattern = re.compile(r"(\bimport\b.*\b%s\b|\b%s\.%s\b)" % (re.escape(name), re.escape(package), re.escape(name)))
        allowed = [a.strip() for a in self.allowed]
        broken = []
        for importer in sorted(graph.find_modules_that_directly_import(package) | {package}):
            if any(importer == a or importer.startswith(a + ".") for a in allowed):
                continue
            for detail in graph.get_import_details(importer=importer, imported=package):
                if pattern.search(detail["line_contents"]):
                    broken.append((importer, detail["line_number"], detail["line_contents"]))
        return ContractCheck(kept=not broken, metadata={"broken": broken})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for importer, line, contents in check.metadata["broken"]:
            output.print_error(f"{importer}:{line}: {contents}  ({self.extension} is for {', '.join(self.allowed)})")
            output.new_line()
