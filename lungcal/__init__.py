"""lungcal: calibrated lung-cancer prediction from chest CT, built on MONAI.

Subpackages (arrows point one way, see docs/architecture.md):
``calibration`` (toolkit, no lungcal imports) <- ``ct``/``data``/``candidates``/``mil`` <- ``ctapp`` <- bundles.
"""
__version__ = "0.1.0"
