// Package doctest reads the reference parts of the user documentation
// (sections, tables, code blocks, code spans and links of a Markdown file) so
// that tests can hold them against the code: the flag tables against the
// flag sets the binaries register, the node configuration reference against
// the config types and their defaults, the chart's values table against
// values.yaml, and every relative link against the files and headings it
// names. Decisions are pure functions over the parsed text (FlagTableErrors,
// LinkErrors); Read is the only file access. Standard library only.
package doctest

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"unicode"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// Doc is a Markdown file, or a part of one, as lines.
type Doc struct {
	// Path is the file's path relative to the repository root.
	Path  string
	Lines []string
	// First is the 1-based line number of Lines[0] in the file.
	First int
}

// Read reads a Markdown file given relative to the repository root.
func Read(rel string) (*Doc, error) {
	root, err := testutil.RepoRoot()
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		return nil, err
	}
	return Parse(rel, string(b)), nil
}

// Parse makes a Doc of Markdown text.
func Parse(path, text string) *Doc {
	return &Doc{Path: path, Lines: strings.Split(text, "\n"), First: 1}
}

// headingLevel is the level of a heading line outside code blocks (0: not
// a heading).
func headingLevel(line string) (int, string) {
	n := 0
	for n < len(line) && line[n] == '#' {
		n++
	}
	if n == 0 || n > 6 || n >= len(line) || line[n] != ' ' {
		return 0, ""
	}
	return n, strings.TrimSpace(line[n+1:])
}

// isFence tells whether a line opens or closes a fenced code block.
func isFence(line string) bool {
	t := strings.TrimSpace(line)
	return strings.HasPrefix(t, "```") || strings.HasPrefix(t, "~~~")
}

// Headings lists the headings of d (not counting lines of code blocks).
func (d *Doc) Headings() []string {
	var out []string
	in := false
	for _, l := range d.Lines {
		if isFence(l) {
			in = !in
			continue
		}
		if lvl, h := headingLevel(l); !in && lvl > 0 {
			out = append(out, h)
		}
	}
	return out
}

// Section is the part of d under the heading whose text is title, up to the
// next heading of the same or a higher level.
func (d *Doc) Section(title string) (*Doc, error) {
	in := false
	start, level := -1, 0
	for i, l := range d.Lines {
		if isFence(l) {
			in = !in
			continue
		}
		lvl, h := headingLevel(l)
		if in || lvl == 0 {
			continue
		}
		if start >= 0 && lvl <= level {
			return &Doc{Path: d.Path, Lines: d.Lines[start:i], First: d.First + start}, nil
		}
		if start < 0 && h == title {
			start, level = i+1, lvl
		}
	}
	if start < 0 {
		return nil, fmt.Errorf("%s: no heading %q", d.Path, title)
	}
	return &Doc{Path: d.Path, Lines: d.Lines[start:], First: d.First + start}, nil
}

// Table is a Markdown table: its header cells and rows of cells.
type Table struct {
	Header []string
	Rows   [][]string
	// Lines are the 1-based line numbers of the rows in the file.
	Lines []int
}

// Tables lists the tables of d outside code blocks.
func (d *Doc) Tables() []Table {
	var out []Table
	var cur *Table
	in := false
	for i, l := range d.Lines {
		if isFence(l) {
			in = !in
		}
		t := strings.TrimSpace(l)
		if in || !strings.HasPrefix(t, "|") {
			cur = nil
			continue
		}
		cells := splitRow(t)
		switch {
		case cur == nil:
			out = append(out, Table{Header: cells})
			cur = &out[len(out)-1]
		case isSeparator(cells):
		default:
			cur.Rows = append(cur.Rows, cells)
			cur.Lines = append(cur.Lines, d.First+i)
		}
	}
	return out
}

// Table is the first table of d whose first header cell is first.
func (d *Doc) Table(first string) (Table, error) {
	for _, t := range d.Tables() {
		if len(t.Header) > 0 && t.Header[0] == first {
			return t, nil
		}
	}
	return Table{}, fmt.Errorf("%s (from line %d): no table with a first column %q", d.Path, d.First, first)
}

func isSeparator(cells []string) bool {
	for _, c := range cells {
		if strings.Trim(c, ":-") != "" || c == "" {
			return false
		}
	}
	return len(cells) > 0
}

// splitRow splits a table row into trimmed cells; a | inside a code span or
// escaped as \| does not split.
func splitRow(row string) []string {
	row = strings.TrimSuffix(strings.TrimPrefix(row, "|"), "|")
	var cells []string
	var b strings.Builder
	code := false
	for i := 0; i < len(row); i++ {
		c := row[i]
		switch {
		case c == '\\' && i+1 < len(row) && row[i+1] == '|':
			b.WriteByte('|')
			i++
		case c == '`':
			code = !code
			b.WriteByte(c)
		case c == '|' && !code:
			cells = append(cells, strings.TrimSpace(b.String()))
			b.Reset()
		default:
			b.WriteByte(c)
		}
	}
	return append(cells, strings.TrimSpace(b.String()))
}

// CodeBlocks lists the contents of the fenced code blocks of d whose info
// string is lang ("" for every block).
func (d *Doc) CodeBlocks(lang string) []string {
	var out []string
	var b strings.Builder
	in, want := false, false
	for _, l := range d.Lines {
		if isFence(l) {
			if in {
				if want {
					out = append(out, b.String())
				}
				b.Reset()
				in = false
				continue
			}
			in = true
			info := strings.TrimSpace(strings.TrimLeft(strings.TrimSpace(l), "`~"))
			want = lang == "" || info == lang
			continue
		}
		if in && want {
			b.WriteString(l)
			b.WriteByte('\n')
		}
	}
	return out
}

var codeSpan = regexp.MustCompile("`([^`]*)`")

// CodeSpans lists the code spans of a piece of Markdown, in order.
func CodeSpans(s string) []string {
	var out []string
	for _, m := range codeSpan.FindAllStringSubmatch(s, -1) {
		out = append(out, m[1])
	}
	return out
}

// TableIn reads docs file rel (relative to the repository root) and
// returns the table whose first header cell is first in its section titled
// section.
func TableIn(rel, section, first string) (Table, error) {
	doc, err := Read(rel)
	if err != nil {
		return Table{}, err
	}
	sec, err := doc.Section(section)
	if err != nil {
		return Table{}, err
	}
	return sec.Table(first)
}

// FlagTableErrors holds a flag table (first column: the flags as code spans,
// `--name` or `-name`, with an optional argument after a space or =;
// second column: the default as the flag package prints it, as the cell's
// first code span, `""` for an empty string) against fs. Every flag of fs
// for which undocumented returns false needs a row; every flag a row names
// must exist in fs with that default. It returns what does not match.
func FlagTableErrors(t Table, fs *flag.FlagSet, undocumented func(name string) bool) []string {
	var errs []string
	if len(t.Header) < 2 || t.Header[1] != "Default" {
		return []string{fmt.Sprintf("flag table: want columns Flag, Default, ...; got %q", t.Header)}
	}
	documented := map[string]bool{}
	for i, row := range t.Rows {
		spans := CodeSpans(row[0])
		if len(spans) == 0 {
			errs = append(errs, fmt.Sprintf("line %d: no flag in %q", t.Lines[i], row[0]))
			continue
		}
		if len(row) < 2 {
			errs = append(errs, fmt.Sprintf("line %d: no default column", t.Lines[i]))
			continue
		}
		defs := CodeSpans(row[1])
		for _, s := range spans {
			name := FlagName(s)
			if name == "" {
				errs = append(errs, fmt.Sprintf("line %d: %q is not a flag", t.Lines[i], s))
				continue
			}
			documented[name] = true
			f := fs.Lookup(name)
			if f == nil {
				errs = append(errs, fmt.Sprintf("line %d: documented flag -%s does not exist", t.Lines[i], name))
				continue
			}
			if len(defs) == 0 {
				errs = append(errs, fmt.Sprintf("line %d: -%s: the default cell %q has no code span (want `%s`)", t.Lines[i], name, row[1], shownDefault(f.DefValue)))
				continue
			}
			if got := unquoteEmpty(defs[0]); got != f.DefValue {
				errs = append(errs, fmt.Sprintf("line %d: -%s: documented default `%s`, the flag's is `%s`", t.Lines[i], name, defs[0], shownDefault(f.DefValue)))
			}
		}
	}
	fs.VisitAll(func(f *flag.Flag) {
		if !documented[f.Name] && (undocumented == nil || !undocumented(f.Name)) {
			errs = append(errs, fmt.Sprintf("flag -%s (%q, default %q) has no row", f.Name, f.Usage, f.DefValue))
		}
	})
	return errs
}

// FlagName is the name of the flag in a code span such as "--node-name",
// "-v N" or "--config=FILE" ("" when it names no flag).
func FlagName(span string) string {
	if !strings.HasPrefix(span, "-") {
		return ""
	}
	name := strings.TrimLeft(span, "-")
	if i := strings.IndexAny(name, " ="); i >= 0 {
		name = name[:i]
	}
	return name
}

func unquoteEmpty(s string) string {
	if s == `""` {
		return ""
	}
	return s
}

func shownDefault(s string) string {
	if s == "" {
		return `""`
	}
	return s
}

// Link is a Markdown link of a Doc.
type Link struct {
	Target string
	Line   int
}

var linkRE = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// Links lists the links of d outside code blocks and code spans.
func (d *Doc) Links() []Link {
	var out []Link
	in := false
	for i, l := range d.Lines {
		if isFence(l) {
			in = !in
			continue
		}
		if in {
			continue
		}
		l = codeSpan.ReplaceAllString(l, "``")
		for _, m := range linkRE.FindAllStringSubmatch(l, -1) {
			out = append(out, Link{Target: m[1], Line: d.First + i})
		}
	}
	return out
}

// Anchors are the link targets GitHub makes of d's headings (Slug, and
// -1, -2, ... for repeated ones).
func (d *Doc) Anchors() map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	for _, h := range d.Headings() {
		s := Slug(h)
		if n := seen[s]; n > 0 {
			out[fmt.Sprintf("%s-%d", s, n)] = true
		} else {
			out[s] = true
		}
		seen[s]++
	}
	return out
}

// Slug is GitHub's anchor of a heading: lower case, letters, digits, - and
// _ kept, spaces made -, everything else dropped.
func Slug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case unicode.IsLetter(r) || unicode.IsDigit(r) || r == '-' || r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteByte('-')
		}
	}
	return b.String()
}

// LinkErrors checks the relative links of the docs (keyed by their path
// relative to the repository root): a link must name an existing file
// (exists) and, with #anchor, a heading of that Markdown file.
func LinkErrors(docs map[string]*Doc, exists func(rel string) bool) []string {
	var errs []string
	paths := make([]string, 0, len(docs))
	for p := range docs {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	anchors := map[string]map[string]bool{}
	for _, p := range paths {
		anchors[p] = docs[p].Anchors()
	}
	for _, p := range paths {
		for _, l := range docs[p].Links() {
			t := l.Target
			if strings.Contains(t, "://") || strings.HasPrefix(t, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(t, "#")
			target := p
			if file != "" {
				target = filepath.ToSlash(filepath.Clean(filepath.Join(filepath.Dir(p), file)))
				if !exists(target) {
					errs = append(errs, fmt.Sprintf("%s:%d: link %s: no file %s", p, l.Line, t, target))
					continue
				}
			}
			if anchor == "" {
				continue
			}
			a, ok := anchors[target]
			if !ok {
				if strings.HasSuffix(target, ".md") {
					errs = append(errs, fmt.Sprintf("%s:%d: link %s: %s is not among the checked docs", p, l.Line, t, target))
				}
				continue
			}
			if !a[anchor] {
				errs = append(errs, fmt.Sprintf("%s:%d: link %s: %s has no heading with anchor #%s", p, l.Line, t, target, anchor))
			}
		}
	}
	return errs
}

// UserDocs are the glob patterns (relative to the repository root) of the
// Markdown files whose reference parts the docs tests hold against the
// code.
var UserDocs = []string{"README.md", "CONTRIBUTING.md", "docs/*.md", "charts/qemu-kubelet/README.md", "e2e/*.md"}

// ReadAll reads the Markdown files matching patterns (relative to the
// repository root), keyed by their slash-separated path.
func ReadAll(patterns ...string) (map[string]*Doc, error) {
	root, err := testutil.RepoRoot()
	if err != nil {
		return nil, err
	}
	out := map[string]*Doc{}
	for _, pattern := range patterns {
		m, err := filepath.Glob(filepath.Join(root, pattern))
		if err != nil {
			return nil, err
		}
		for _, f := range m {
			rel, err := filepath.Rel(root, f)
			if err != nil {
				return nil, err
			}
			d, err := Read(rel)
			if err != nil {
				return nil, err
			}
			out[filepath.ToSlash(rel)] = d
		}
	}
	return out, nil
}
