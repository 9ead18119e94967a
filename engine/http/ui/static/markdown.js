// A small Markdown renderer and code highlighter for the chat page: enough of CommonMark for
// model answers (fenced code, headings, lists, quotes, tables, emphasis, links, inline code).
// Every piece of text is HTML-escaped before any tag is made, and a link is made only for
// http(s) and mailto addresses, so an answer can never inject markup or script.
"use strict";

(function () {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => ESCAPES[c]);

  // ---- code highlighting --------------------------------------------------------------------
  const words = (text) => new Set(text.split(" "));
  const C_LIKE = "if else for while do switch case break continue return goto default struct " +
    "enum union typedef const static extern void int char long short float double unsigned " +
    "signed sizeof class public private protected virtual template typename namespace using " +
    "new delete this throw try catch auto bool inline";
  const KEYWORDS = {
    python: words("def class return if elif else for while in not and or is import from as " +
      "with try except finally raise pass break continue lambda yield global nonlocal assert " +
      "del async await match case"),
    js: words("function return if else for while do switch case break continue var let const " +
      "new delete typeof instanceof in of class extends super this throw try catch finally " +
      "async await yield import export from default void interface type enum"),
    c: words(C_LIKE),
    rust: words("fn let mut pub struct enum impl trait for while loop if else match return use " +
      "mod crate self Self as in ref move where const static unsafe async await dyn type"),
    go: words("func package import var const type struct interface map chan go defer if else " +
      "for range switch case default return break continue select fallthrough"),
    bash: words("if then else elif fi for while until do done case esac in function return " +
      "export local echo exit set unset source"),
    sql: words("select from where insert into values update set delete create table drop alter " +
      "join left right inner outer on group by order having limit and or not null as index"),
  };
  const LITERALS = words("true false null None True False nil undefined NULL");
  const ALIASES = {
    py: "python", python3: "python", javascript: "js", ts: "js", typescript: "js", json: "js",
    jsx: "js", tsx: "js", cpp: "c", "c++": "c", h: "c", hpp: "c", java: "c", cs: "c",
    csharp: "c", kotlin: "c", swift: "c", rs: "rust", golang: "go", sh: "bash", shell: "bash",
    zsh: "bash", console: "bash",
  };
  const HASH_COMMENTS = new Set(["python", "bash"]);

  function tokenPattern(lang) {
    const comment = lang === "sql" ? "--[^\\n]*" :
      HASH_COMMENTS.has(lang) ? "#[^\\n]*" : "\\/\\/[^\\n]*|\\/\\*[\\s\\S]*?\\*\\/";
    const string = "\"(?:[^\"\\\\\\n]|\\\\.)*\"?|'(?:[^'\\\\\\n]|\\\\.)*'?|`[^`]*`?";
    const number = "\\b(?:0[xX][0-9a-fA-F]+|\\d+(?:\\.\\d+)?(?:[eE][+-]?\\d+)?)\\b";
    return new RegExp(`(${comment})|(${string})|(${number})|([A-Za-z_][\\w]*)`, "g");
  }

  function highlightCode(code, language) {
    const lang = ALIASES[language] || language;
    const keywords = KEYWORDS[lang] || new Set();
    const pattern = tokenPattern(lang);
    let html = "";
    let last = 0;
    for (const m of code.matchAll(pattern)) {
      html += escapeHtml(code.slice(last, m.index));
      last = m.index + m[0].length;
      const text = escapeHtml(m[0]);
      let kind = null;
      if (m[1]) kind = "comment";
      else if (m[2]) kind = "string";
      else if (m[3]) kind = "number";
      else if (keywords.has(m[4])) kind = "keyword";
      else if (LITERALS.has(m[4])) kind = "literal";
      else if (code[last] === "(") kind = "function";
      html += kind ? `<span class="tok-${kind}">${text}</span>` : text;
    }
    return html + escapeHtml(code.slice(last));
  }

  function codeBlock(code, language) {
    const label = escapeHtml(language || "text");
    return `<div class="code-block"><div class="code-head"><span>${label}</span>` +
      `<button type="button" class="copy">Copy</button></div>` +
      `<pre><code>${highlightCode(code, (language || "").toLowerCase())}</code></pre></div>`;
  }

  // ---- inline ---------------------------------------------------------------------------------
  const SAFE_URL = /^(https?:\/\/|mailto:)/i;

  function inlineText(escaped) {
    return escaped
      .replace(/\[([^\]]+)\]\(([^()\s]+)\)/g, (whole, label, url) => SAFE_URL.test(url) ?
        `<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>` : whole)
      .replace(/\*\*(?=\S)([^*]*?\S)\*\*|__(?=\S)([^_]*?\S)__/g,
        (_, a, b) => `<strong>${a || b}</strong>`)
      .replace(/(^|[^*\w])\*(?=[^\s*])([^*]*?[^\s*])?\*(?!\*)/g,
        (whole, lead, body) => body === undefined ? whole : `${lead}<em>${body}</em>`)
      .replace(/~~(?=\S)([^~]*?\S)~~/g, "<del>$1</del>");
  }

  function inline(text) {
    // Code spans first: nothing inside them is Markdown.
    return text.split(/(`+[^`]*?`+)/).map((part, i) => {
      if (i % 2 === 1) {
        const body = part.replace(/^`+\s?|\s?`+$/g, "");
        return `<code>${escapeHtml(body)}</code>`;
      }
      return inlineText(escapeHtml(part));
    }).join("");
  }

  // ---- blocks ---------------------------------------------------------------------------------
  const FENCE = /^\s{0,3}(```+|~~~+)\s*([^\s`]*)/;
  const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^\s{0,3}>\s?/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  const startsBlock = (line, next) => FENCE.test(line) || HEADING.test(line) ||
    RULE.test(line) || QUOTE.test(line) || ITEM.test(line) || isTableStart(line, next);
  const isTableStart = (line, next) => line.includes("|") && next !== undefined &&
    next.includes("-") && TABLE_RULE.test(next);

  function fenced(lines, i) {
    const [, marker, language] = lines[i].match(FENCE);
    const body = [];
    let j = i + 1;
    // An unclosed fence (an answer still streaming) runs to the end.
    while (j < lines.length && !lines[j].trim().startsWith(marker)) body.push(lines[j++]);
    return [codeBlock(body.join("\n"), language), j + 1];
  }

  // A list's kind: its bullet character, or an ordered list's delimiter ("." or ")"). Items of
  // one kind at one indent make one list, blank lines between them included (CommonMark).
  const listKind = (marker) => (/\d/.test(marker) ? marker.slice(-1) : marker);

  function list(lines, i) {
    const first = lines[i].match(ITEM);
    const indent = first[1].length;
    const kind = listKind(first[2]);
    const sameList = (m) => m && m[1].length === indent && listKind(m[2]) === kind;
    const items = [];
    let loose = false; // blank lines between items, or inside one: its blocks keep their <p>
    let j = i;
    while (j < lines.length) {
      const m = lines[j].match(ITEM);
      if (sameList(m)) {
        items.push([m[3]]);
      } else if (m && m[1].length <= indent) {
        break; // another kind of list, or an outer list's next item
      } else if (lines[j].trim() === "") {
        let k = j;
        while (k < lines.length && lines[k].trim() === "") k++;
        const goesOn = k < lines.length &&
          (sameList(lines[k].match(ITEM)) || lines[k].search(/\S/) > indent);
        if (!goesOn) break;
        loose = true;
        if (!sameList(lines[k].match(ITEM))) items[items.length - 1].push("");
        j = k;
        continue;
      } else if (lines[j].search(/\S/) > indent || !startsBlock(lines[j])) {
        items[items.length - 1].push(lines[j].slice(Math.min(indent + 2, lines[j].search(/\S/))));
      } else {
        break;
      }
      j++;
    }
    const number = parseInt(first[2], 10);
    const open = Number.isNaN(number) ? "<ul>" : number === 1 ? "<ol>" : `<ol start="${number}">`;
    const body = items.map((item) => {
      const html = blocks(item);
      // A tight list's item text sits in the <li> itself, not in a paragraph.
      const tight = html.replace(/^<p>((?:(?!<p>)[\s\S])*?)<\/p>(?=$|<[uo]l)/, "$1");
      return `<li>${loose ? html : tight}</li>`;
    }).join("");
    return [`${open}${body}</${Number.isNaN(number) ? "ul" : "ol"}>`, j];
  }

  function table(lines, i) {
    const cells = (line) => line.trim().replace(/^\||\|$/g, "").split("|").map((c) => c.trim());
    const head = cells(lines[i]).map((c) => `<th>${inline(c)}</th>`).join("");
    let j = i + 2;
    let rows = "";
    while (j < lines.length && lines[j].includes("|") && lines[j].trim() !== "") {
      rows += `<tr>${cells(lines[j]).map((c) => `<td>${inline(c)}</td>`).join("")}</tr>`;
      j++;
    }
    return [`<div class="table"><table><thead><tr>${head}</tr></thead>` +
      `<tbody>${rows}</tbody></table></div>`, j];
  }

  function paragraph(lines, i) {
    const body = [lines[i]];
    let j = i + 1;
    while (j < lines.length && lines[j].trim() !== "" && !startsBlock(lines[j], lines[j + 1])) {
      body.push(lines[j++]);
    }
    return [`<p>${body.map((l) => inline(l.trim())).join("<br>")}</p>`, j];
  }

  function blocks(lines) {
    let html = "";
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let block;
      if (line.trim() === "") { i++; continue; }
      if (FENCE.test(line)) block = fenced(lines, i);
      else if (HEADING.test(line)) {
        const [, marks, text] = line.match(HEADING);
        block = [`<h${marks.length}>${inline(text)}</h${marks.length}>`, i + 1];
      } else if (RULE.test(line)) block = ["<hr>", i + 1];
      else if (QUOTE.test(line)) {
        const quoted = [];
        let j = i;
        while (j < lines.length && QUOTE.test(lines[j])) quoted.push(lines[j++].replace(QUOTE, ""));
        block = [`<blockquote>${blocks(quoted)}</blockquote>`, j];
      } else if (ITEM.test(line)) block = list(lines, i);
      else if (isTableStart(line, lines[i + 1])) block = table(lines, i);
      else block = paragraph(lines, i);
      html += block[0];
      i = block[1];
    }
    return html;
  }

  function renderMarkdown(text) {
    return blocks(text.replace(/\r\n?/g, "\n").split("\n"));
  }

  window.renderMarkdown = renderMarkdown;
  window.highlightCode = highlightCode;
  window.escapeHtml = escapeHtml;
})();
