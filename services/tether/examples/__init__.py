"""Example harnesses, shipped in the package so `tether demo` runs from an installed wheel."""
