"""Streamlit app and plotly figures (placeholder until the visualizer issue)."""
