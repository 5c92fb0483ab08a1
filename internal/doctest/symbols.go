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
	"strings"
)

// Symbols are the declared names of a module's Go packages, by package
// name (packages of the same name, such as the two v1alpha1, share an
// entry): top-level functions, types, variables and constants as "Name",
// methods, struct fields and interface methods as "Type.Name".
type Symbols map[string]map[string]bool

// ReadSymbols parses every Go file under root (test files included, their
// external test packages under the package's name; testdata, hidden and
// vendor directories skipped) for the names it declares.
func ReadSymbols(root string) (Symbols, error) {
	out := Symbols{}
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
		if !strings.HasSuffix(name, ".go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return fmt.Errorf("parse %s: %w", path, err)
		}
		out.add(f)
		return nil
	})
	return out, err
}

func (s Symbols) add(f *ast.File) {
	pkg := strings.TrimSuffix(f.Name.Name, "_test")
	names := s[pkg]
	if names == nil {
		names = map[string]bool{}
		s[pkg] = names
	}
	for _, decl := range f.Decls {
		switch d := decl.(type) {
		case *ast.FuncDecl:
			if d.Recv == nil || len(d.Recv.List) == 0 {
				names[d.Name.Name] = true
				continue
			}
			if recv := recvType(d.Recv.List[0].Type); recv != "" {
				names[recv+"."+d.Name.Name] = true
			}
		case *ast.GenDecl:
			for _, spec := range d.Specs {
				switch sp := spec.(type) {
				case *ast.ValueSpec:
					for _, n := range sp.Names {
						names[n.Name] = true
					}
				case *ast.TypeSpec:
					names[sp.Name.Name] = true
					for _, m := range members(sp.Type) {
						names[sp.Name.Name+"."+m] = true
					}
				}
			}
		}
	}
}

// recvType is the type name of a method's receiver (T, *T, T[P]).
func recvType(e ast.Expr) string {
	for {
		switch t := e.(type) {
		case *ast.StarExpr:
			e = t.X
		case *ast.IndexExpr:
			e = t.X
		case *ast.IndexListExpr:
			e = t.X
		case *ast.Ident:
			return t.Name
		default:
			return ""
		}
	}
}

// members are the field names of a struct type (embedded ones by their
// type's name) and the method names of an interface type.
func members(e ast.Expr) []string {
	var list *ast.FieldList
	switch t := e.(type) {
	case *ast.StructType:
		list = t.Fields
	case *ast.InterfaceType:
		list = t.Methods
	default:
		return nil
	}
	var out []string
	for _, f := range list.List {
		for _, n := range f.Names {
			out = append(out, n.Name)
		}
		if len(f.Names) == 0 {
			if n := recvType(f.Type); n != "" {
				out = append(out, n)
			} else if sel, ok := f.Type.(*ast.SelectorExpr); ok {
				out = append(out, sel.Sel.Name)
			}
		}
	}
	return out
}

// symbolRef is a code span naming a Go symbol as pkg.Name or
// pkg.Type.Member (an exported Name), optionally followed by a call's
// parentheses, a composite literal's braces or a type's asterisk before
// it: `provider.NewVMs`, `*oci.Store`, `exporter.Settings{}`,
// `Pod.SetSize(check, change)` does not match (no package).
var symbolRef = regexp.MustCompile(`^[*&]?([a-z][a-z0-9]*)\.([A-Z][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?(?:\(.*\)|\{.*\}|\[.*\])?$`)

// memberRef is a code span naming a member of a type without its
// package: `VMs.SetFeatures`, `(*VMs).run`, `Spec.Arch`.
var memberRef = regexp.MustCompile(`^(?:\(\*([A-Z][A-Za-z0-9_]*)\)|([A-Z][A-Za-z0-9_]*))\.([A-Za-z_][A-Za-z0-9_]*)(?:\(.*\))?$`)

// SymbolRef is a Go symbol a doc names. Pkg is "" for a Type.Member
// reference without a package.
type SymbolRef struct {
	Pkg, Name string
	Line      int
}

// SymbolRefs lists the code spans of d (outside code blocks) that name a
// symbol of one of the packages in pkgs (their package names); spans
// naming other packages (corev1.Pod, metav1.Time) are not a module's
// symbols and are left out.
func (d *Doc) SymbolRefs(pkgs Symbols) []SymbolRef {
	var out []SymbolRef
	in := false
	for i, l := range d.Lines {
		if isFence(l) {
			in = !in
			continue
		}
		if in {
			continue
		}
		for _, span := range CodeSpans(l) {
			span = strings.TrimSpace(span)
			if m := memberRef.FindStringSubmatch(span); m != nil {
				if typ := m[1] + m[2]; pkgs.declaresType(typ) {
					out = append(out, SymbolRef{Name: typ + "." + m[3], Line: d.First + i})
				}
				continue
			}
			m := symbolRef.FindStringSubmatch(span)
			if m == nil {
				continue
			}
			if _, ok := pkgs[m[1]]; !ok {
				continue
			}
			name := m[2]
			if m[3] != "" {
				name += "." + m[3]
			}
			out = append(out, SymbolRef{Pkg: m[1], Name: name, Line: d.First + i})
		}
	}
	return out
}

// SymbolErrors checks that every pkg.Symbol the docs name is declared in
// a package of that name. A pkg.Type.Member reference needs the member; a
// pkg.Name.Other where Name is no type is read as a value's field or
// method path, and only pkg.Name is checked.
func SymbolErrors(docs map[string]*Doc, pkgs Symbols) []string {
	var errs []string
	paths := make([]string, 0, len(docs))
	for p := range docs {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	for _, p := range paths {
		for _, r := range docs[p].SymbolRefs(pkgs) {
			if r.Pkg == "" {
				if !pkgs.declaresMember(r.Name) {
					typ, member, _ := strings.Cut(r.Name, ".")
					errs = append(errs, fmt.Sprintf("%s:%d: `%s`: no type %s of the module has a field or method %s", p, r.Line, r.Name, typ, member))
				}
				continue
			}
			names := pkgs[r.Pkg]
			if names[r.Name] {
				continue
			}
			top, member, nested := strings.Cut(r.Name, ".")
			if nested && names[top] && !hasMembers(names, top) {
				continue // a variable's field or method
			}
			if nested && names[top] {
				errs = append(errs, fmt.Sprintf("%s:%d: `%s.%s`: %s.%s has no field or method %s", p, r.Line, r.Pkg, r.Name, r.Pkg, top, member))
				continue
			}
			errs = append(errs, fmt.Sprintf("%s:%d: `%s.%s`: no package %s of the module declares %s%s", p, r.Line, r.Pkg, r.Name, r.Pkg, top, elsewhere(pkgs, top, r.Pkg)))
		}
	}
	return errs
}

// declaresType tells whether a package of the module declares a type
// (or any name with members) typ.
func (s Symbols) declaresType(typ string) bool {
	for _, names := range s {
		if names[typ] && hasMembers(names, typ) {
			return true
		}
	}
	return false
}

// declaresMember tells whether a package of the module declares
// Type.Member.
func (s Symbols) declaresMember(ref string) bool {
	for _, names := range s {
		if names[ref] {
			return true
		}
	}
	return false
}

func hasMembers(names map[string]bool, typ string) bool {
	for n := range names {
		if strings.HasPrefix(n, typ+".") {
			return true
		}
	}
	return false
}

// elsewhere names the packages that do declare name, as a hint.
func elsewhere(pkgs Symbols, name, not string) string {
	var in []string
	for p, names := range pkgs {
		if p != not && names[name] {
			in = append(in, p)
		}
	}
	if len(in) == 0 {
		return ""
	}
	slices.Sort(in)
	return " (declared in package " + strings.Join(in, ", ") + ")"
}
