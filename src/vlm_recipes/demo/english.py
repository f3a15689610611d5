"""Everyday English words the demo's tiny tokenizers are trained on beside the demo rows' own texts
(demo/dataset.py: tokenizer_corpus)."""

ENGLISH_WORDS = (
    "the a an of and to in is it that this what which how many where there are was be on at for with "
    "from by as or not no yes one two three four five six seven eight nine ten left right top bottom "
    "middle shape shapes circle square triangle colour color red green blue yellow purple orange black "
    "white image picture question answer please describe extract nutrition facts label calories fat "
    "carbs protein sugar sodium json value number count total serving size per you are a helpful "
    "assistant system user can see show tell me about small large big word text line first last "
    "people time year day way thing world life hand part child eye woman place work week case point "
    "government company group problem fact house water money month night story lot study book job "
    "name mother father country school family state student room area program other "
    "know think take come make want look use find give feel become leave call keep begin seem help "
    "talk turn start might should would could every never always often before after because while "
    "through between under again still also just only even really very most some more less much "
    "good new old great little long high different important public early young social able bad "
    "report result reason research example information service development history market education "
    "computer training model learning vision language dataset evaluation accuracy caption "
    "video clip frame seconds dot move moves moving way up down same different "
    "object person animal car tree dog cat street desk chair window door light background "
    "written printed receipt document chart graph table row column cell heading title amount price"
)
