"""No module of polar_lab imports itself back through others (issue 42). The layers contract (pyproject.toml,
`lint-imports`) keeps imports pointing down between layers; this finds a circle inside one (as `proxy/http.py` ↔
`proxy/streaming.py` was), function-level imports included."""

import grimp


def _circles(graph) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_module_imports_itself_back():
    assert _circles(grimp.build_graph("polar_lab")) == []


def test_the_check_finds_a_circle():
    graph = grimp.ImportGraph()
    for name in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(name)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    graph.add_import(importer="pkg.b", imported="pkg.c")
    assert _circles(graph) == [["pkg.a", "pkg.b"]]
