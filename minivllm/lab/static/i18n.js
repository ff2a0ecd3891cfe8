// The page's two languages: English and Chinese (the tutorial chapter's language), one file each.

import { EN } from "./words_en.js";
import { ZH } from "./words_zh.js";

export const I18N = { en: EN, zh: ZH };
