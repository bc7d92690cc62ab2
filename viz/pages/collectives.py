"""Collectives: a schedule, round by round (being built)."""

import streamlit as st

st.title("Collectives")
