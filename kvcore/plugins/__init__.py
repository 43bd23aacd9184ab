"""Plugins: the pluggy registry every pluggable kind goes through, built-ins and third parties alike;
the kinds, the architecture lookup and the support tables generated from the declarations."""
