"""The model families as data, torch-free: the GUI, validation, the memory plan and the docs read them without
loading any model code.

    registry.py        one `FamilyInfo` per family (`FAMILIES`): names, pipelines, built-in demo, the fields that
                       apply, LoRA targets, measured activations; recognising a model's family from its files
    text_encoders.py   the kinds of text encoder the families name, and what each decides
    lora_clients.py    which program (ComfyUI, diffusers) applies which of a family's LoRA files exactly

What loads and trains a family is its torch side, `modules/model/families/`, which reads this registry.
"""
