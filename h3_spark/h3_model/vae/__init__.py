"""The video and audio VAEs and their loading (diffusers folders, ComfyUI single files, the released layout)."""
