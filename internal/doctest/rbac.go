package doctest

import (
	"fmt"
	"slices"
	"strings"
)

// Grant is one verb on one resource that a subject (controller, node
// agent) is granted, at a scope: "cluster" (a ClusterRole), "release
// namespace", or a namespace by name (a Role there).
type Grant struct {
	Subject, Scope, Group, Resource, Verb string
}

func (g Grant) String() string {
	group := g.Group
	if group == "" {
		group = "core"
	}
	return fmt.Sprintf("%s: %s %s/%s (%s)", g.Subject, g.Verb, group, g.Resource, g.Scope)
}

// RBACRow is a row of an RBAC table: the grants it documents and the
// values (chart value path to value, as helm --set writes them) under
// which they are given; an empty When is always.
type RBACRow struct {
	Line   int
	Grants []Grant
	When   map[string]string
}

// RBACRows reads an RBAC table: columns Subject, Scope (cluster, release
// namespace or a namespace as a code span), API group (core or a code
// span), Resources (code spans), Verbs (comma-separated), When (code spans
// value=x, all of which must hold; empty: always), and any more.
func RBACRows(path string, t Table) ([]RBACRow, []string) {
	want := []string{"Subject", "Scope", "API group", "Resources", "Verbs", "When"}
	if len(t.Header) < len(want) || !slices.Equal(t.Header[:len(want)], want) {
		return nil, []string{fmt.Sprintf("%s: RBAC table: want columns %q, ...; got %q", path, want, t.Header)}
	}
	var rows []RBACRow
	var errs []string
	for i, cells := range t.Rows {
		at := fmt.Sprintf("%s:%d", path, t.Lines[i])
		if len(cells) < len(want) {
			errs = append(errs, fmt.Sprintf("%s: want %d cells, got %d", at, len(t.Header), len(cells)))
			continue
		}
		scope := strings.TrimSpace(cells[1])
		switch {
		case strings.HasPrefix(scope, "cluster"):
			scope = "cluster"
		case strings.HasPrefix(scope, "release namespace"):
			scope = "release namespace"
		case len(CodeSpans(scope)) == 1:
			scope = CodeSpans(scope)[0]
		default:
			errs = append(errs, fmt.Sprintf("%s: scope %q is not cluster, release namespace or a `namespace`", at, cells[1]))
			continue
		}
		group := ""
		if cells[2] != "core" {
			if g := CodeSpans(cells[2]); len(g) == 1 {
				group = g[0]
			} else {
				errs = append(errs, fmt.Sprintf("%s: API group %q is not core or one `group`", at, cells[2]))
				continue
			}
		}
		resources := CodeSpans(cells[3])
		var verbs []string
		for _, v := range strings.Split(cells[4], ",") {
			if v = strings.TrimSpace(v); v != "" {
				verbs = append(verbs, v)
			}
		}
		if len(resources) == 0 || len(verbs) == 0 {
			errs = append(errs, fmt.Sprintf("%s: no resources (code spans) or no verbs in %q, %q", at, cells[3], cells[4]))
			continue
		}
		row := RBACRow{Line: t.Lines[i], When: map[string]string{}}
		for _, c := range CodeSpans(cells[5]) {
			k, v, ok := strings.Cut(c, "=")
			if !ok {
				errs = append(errs, fmt.Sprintf("%s: When %q is not value=x", at, c))
				continue
			}
			row.When[k] = v
		}
		for _, r := range resources {
			for _, v := range verbs {
				row.Grants = append(row.Grants, Grant{Subject: cells[0], Scope: scope, Group: group, Resource: r, Verb: v})
			}
		}
		rows = append(rows, row)
	}
	return rows, errs
}

// RBACErrors compares the grants the rows document under one set of
// values (applies tells whether a row's When holds there) with the grants
// the chart renders with those values (described by render): every
// rendered grant needs a row that applies, and every grant of such a row
// must be rendered.
func RBACErrors(path string, rows []RBACRow, applies func(when map[string]string) bool, rendered []Grant, render string) []string {
	var errs []string
	documented := map[Grant]int{}
	for _, r := range rows {
		if !applies(r.When) {
			continue
		}
		for _, g := range r.Grants {
			documented[g] = r.Line
		}
	}
	chart := map[Grant]bool{}
	for _, g := range rendered {
		chart[g] = true
		if _, ok := documented[g]; !ok {
			errs = append(errs, fmt.Sprintf("%s: the chart (%s) grants %s, which no row of the RBAC table says", path, render, g))
		}
	}
	for g, line := range documented {
		if !chart[g] {
			errs = append(errs, fmt.Sprintf("%s:%d: documents %s, which the chart (%s) does not grant", path, line, g, render))
		}
	}
	slices.Sort(errs)
	return errs
}
