// Entry of the anywidget ES module: only a default export ({ render }); a bare `render` export is
// deprecated by anywidget and warns on every render.
import { render } from "./explorer.js";

export default { render };
