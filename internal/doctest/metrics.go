package doctest

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// Family is a Prometheus metric family as a binary registers it.
type Family struct {
	// Type is counter, gauge, histogram or summary; "" when the registry
	// does not say (a family checked by name only).
	Type string
	// Labels are its label names; nil when the registry does not say.
	Labels []string
	// Values are the label values it exports before any event (the
	// series a vector starts with at zero), by label.
	Values map[string][]string
}

// LabelDoc is a label a metric table's Labels cell names, with the values
// it lists for it: `kind` (`console`, `tcp`), `result`: `a`, `b`,
// `controller="exporterset"`. Open is set when the list ends with "..."
// (more values than listed).
type LabelDoc struct {
	Name   string
	Values []string
	Open   bool
}

var (
	spanRE     = regexp.MustCompile("`([^`]*)`")
	metricName = regexp.MustCompile(`^[a-zA-Z_:][a-zA-Z0-9_:]*$`)
	labelEq    = regexp.MustCompile(`^([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"$`)
)

// ParseLabels reads a Labels cell: each code span outside parentheses and
// before a colon names a label (or label="value"); the spans inside the
// parentheses after it, or after a colon following it, are its values.
func ParseLabels(cell string) []LabelDoc {
	var out []LabelDoc
	depth, colon, last := 0, false, 0
	for _, m := range spanRE.FindAllStringSubmatchIndex(cell, -1) {
		between := cell[last:m[0]]
		depth += strings.Count(between, "(") - strings.Count(between, ")")
		if len(out) > 0 && depth == 0 && !colon && strings.Contains(between, ":") {
			colon = true
		}
		if len(out) > 0 && (strings.Contains(between, "...") || strings.Contains(between, "…")) {
			out[len(out)-1].Open = true
		}
		span := cell[m[2]:m[3]]
		last = m[1]
		if len(out) > 0 && (depth > 0 || colon) {
			out[len(out)-1].Values = append(out[len(out)-1].Values, span)
			continue
		}
		if eq := labelEq.FindStringSubmatch(span); eq != nil {
			out = append(out, LabelDoc{Name: eq[1], Values: []string{eq[2]}, Open: true})
			continue
		}
		out = append(out, LabelDoc{Name: span})
	}
	if rest := cell[last:]; len(out) > 0 && (strings.Contains(rest, "...") || strings.Contains(rest, "…")) {
		out[len(out)-1].Open = true
	}
	return out
}

// MetricTableErrors holds a metric table (columns Metric, Type
// (optional), Labels, ...: the metric names as code spans, their types,
// their labels as ParseLabels reads them) against the families the binaries register
// (lookup). A documented metric must be registered with that type and
// exactly those labels (a family known by name only, Labels nil, is
// checked by name and type); a label's listed values must each be one the
// family exports from the start or one the code can give (known); a
// closed list (no "...") must hold every value the family exports from
// the start. It returns what does not match and the metric names the
// table documents.
func MetricTableErrors(path string, t Table, lookup func(name string) (*Family, bool), known func(value string) bool) (errs, documented []string) {
	typeCol, labelCol := slices.Index(t.Header, "Type"), slices.Index(t.Header, "Labels")
	if len(t.Header) == 0 || t.Header[0] != "Metric" || labelCol < 0 {
		return []string{fmt.Sprintf("%s: metric table: want columns Metric, [Type,] Labels, ...; got %q", path, t.Header)}, nil
	}
	for i, row := range t.Rows {
		at := fmt.Sprintf("%s:%d", path, t.Lines[i])
		if len(row) <= max(typeCol, labelCol) {
			errs = append(errs, fmt.Sprintf("%s: want %d cells, got %d", at, len(t.Header), len(row)))
			continue
		}
		var names []string
		for _, s := range CodeSpans(row[0]) {
			if metricName.MatchString(s) {
				names = append(names, s)
			}
		}
		if len(names) == 0 {
			errs = append(errs, fmt.Sprintf("%s: no metric name in %q", at, row[0]))
			continue
		}
		var types []string
		if typeCol >= 0 {
			types = strings.Split(row[typeCol], ",")
			for j := range types {
				types[j] = strings.TrimSpace(types[j])
			}
		}
		labels := ParseLabels(row[labelCol])
		for j, name := range names {
			documented = append(documented, name)
			f, ok := lookup(name)
			if !ok {
				errs = append(errs, fmt.Sprintf("%s: metric %s is not registered by the binaries", at, name))
				continue
			}
			typ := ""
			if len(types) == len(names) {
				typ = types[j]
			} else if len(types) > 0 {
				typ = types[0]
			}
			if f.Type != "" && typ != "" && typ != f.Type {
				errs = append(errs, fmt.Sprintf("%s: metric %s documented as %s, registered as a %s", at, name, typ, f.Type))
			}
			errs = append(errs, labelErrors(at, name, f, labels, known)...)
		}
	}
	return errs, documented
}

func labelErrors(at, name string, f *Family, labels []LabelDoc, known func(string) bool) []string {
	var errs []string
	if f.Labels == nil {
		return nil // known by name only: its labels and values are not ours to check
	}
	var got []string
	for _, l := range labels {
		got = append(got, l.Name)
	}
	want := slices.Sorted(slices.Values(f.Labels))
	if slices.Sort(got); !slices.Equal(got, want) {
		errs = append(errs, fmt.Sprintf("%s: metric %s documented with labels %q, registered with %q", at, name, got, want))
	}
	for _, l := range labels {
		if !slices.Contains(f.Labels, l.Name) {
			continue // reported above
		}
		start := f.Values[l.Name]
		for _, v := range l.Values {
			if !slices.Contains(start, v) && !known(v) {
				errs = append(errs, fmt.Sprintf("%s: metric %s: label %s value %q is neither exported from the start nor a string the code holds", at, name, l.Name, v))
			}
		}
		if l.Open || len(l.Values) == 0 {
			continue
		}
		for _, v := range start {
			if !slices.Contains(l.Values, v) {
				errs = append(errs, fmt.Sprintf("%s: metric %s: label %s value %q is exported but not in the documented list %q (end it with ... if it is not the whole set)", at, name, l.Name, v, l.Values))
			}
		}
	}
	return errs
}

// StringLiterals are the string constants of the module's non-test Go
// source under root (testdata, hidden and vendor directories skipped): the
// values code can give a label without the registry knowing them in
// advance.
func StringLiterals(root string) (map[string]bool, error) {
	out := map[string]bool{}
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if path != root && (strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "testdata" || name == "vendor") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return fmt.Errorf("parse %s: %w", path, err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			if lit, ok := n.(*ast.BasicLit); ok && lit.Kind == token.STRING {
				if s, err := strconv.Unquote(lit.Value); err == nil {
					out[s] = true
				}
			}
			return true
		})
		return nil
	})
	return out, err
}
