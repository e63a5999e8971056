"""The dashboard's pages (Streamlit scripts run by app.py's st.navigation) and their shared helpers.

Not named pages/: Streamlit treats a pages/ directory beside the main script as the old, file-per-page
multipage mode and never runs app.py's st.navigation.
"""
