"""A hospital's own data: is the site like the reference (``lungcal site-check``), local recalibration of a
shipped model with an optional threshold guarantee (``lungcal recalibrate``), and how many labelled site CTs
fine-tuning needs (``lungcal adapt-curve``)."""
