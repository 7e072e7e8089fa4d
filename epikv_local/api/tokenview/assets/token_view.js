(function(){
  var tip=document.getElementById('tip');
  document.querySelectorAll('.tok[title]').forEach(function(s){s.dataset.tip=s.title;s.removeAttribute('title');});
  function show(e){
    var s=e.target.closest('.tok'); if(!s||!s.dataset.tip){return;}
    tip.textContent=s.dataset.tip; tip.style.display='block';
    var x=Math.min(e.clientX+14,window.innerWidth-370), y=e.clientY+16;
    if(y+110>window.innerHeight){y=e.clientY-110;}
    tip.style.left=x+'px'; tip.style.top=y+'px';
    var p=s.dataset.p, scope=s.closest('.case')||document;  /* the same position in this prompt's runs only */
    scope.querySelectorAll('.tok[data-p="'+p+'"]').forEach(function(o){o.classList.add('hl');});
  }
  function hide(e){
    var s=e.target.closest('.tok'); tip.style.display='none';
    if(s){document.querySelectorAll('.tok.hl').forEach(function(o){o.classList.remove('hl');});}
  }
  document.addEventListener('mouseover',show); document.addEventListener('mouseout',hide);
  var box=document.getElementById('hide-ev');
  if(box){box.addEventListener('change',function(){document.body.classList.toggle('hide-ev',box.checked);});}
})();
